//! Lowering the scheduling priority of the calling thread, for the threads that receive and
//! decode events.
//!
//! On a host where event ingestion and lookups share few cores, the scheduler splits a core
//! evenly between every runnable thread. Decoding is the cheap, parallel half of ingestion:
//! a listener that runs ahead only fills the bounded queue of a writer thread (or waits for
//! the index lock), while the index write and `/select` are the serial work everyone waits
//! for. A higher nice value on the receiving threads gives the others the larger share of a
//! contended core without starving the receivers (unlike `SCHED_IDLE`): an idle core still
//! runs them at full speed.
//!
//! Linux keeps a nice value per thread (the POSIX per-process attribute is per thread under
//! NPTL), and a thread inherits its creator's, so libzmq's I/O threads started from a
//! lowered thread are lowered too. Raising a nice value needs no privilege; lowering it back
//! does, so nothing here ever tries.

/// The highest nice value (the lowest priority) Linux accepts.
pub const MAX_NICE: u8 = 19;

/// Raises the calling thread's nice value by `by` (capped at [`MAX_NICE`]); 0 changes
/// nothing. Elsewhere than on Linux, where the value belongs to the whole process, it
/// changes nothing either.
pub fn lower_thread_priority(by: u8) -> std::io::Result<()> {
    if by == 0 {
        return Ok(());
    }
    lower(by)
}

#[cfg(target_os = "linux")]
fn lower(by: u8) -> std::io::Result<()> {
    use rustix::process::{getpriority_process, setpriority_process};
    // `None`: the calling thread on Linux (see the module doc).
    let now = getpriority_process(None)?;
    let target = now.saturating_add(i32::from(by)).min(i32::from(MAX_NICE));
    setpriority_process(None, target)?;
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn lower(_by: u8) -> std::io::Result<()> {
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use rustix::process::getpriority_process;

    #[test]
    fn lowers_only_the_calling_thread() {
        let before = getpriority_process(None).unwrap();
        let lowered = std::thread::spawn(move || {
            lower_thread_priority(5).unwrap();
            let mine = getpriority_process(None).unwrap();
            // A thread started from a lowered one inherits its value.
            let child = std::thread::spawn(|| getpriority_process(None).unwrap())
                .join()
                .unwrap();
            (mine, child)
        })
        .join()
        .unwrap();
        let expected = (before + 5).min(i32::from(MAX_NICE));
        assert_eq!(lowered, (expected, expected));
        assert_eq!(getpriority_process(None).unwrap(), before);
    }

    #[test]
    fn caps_at_the_highest_nice_value_and_zero_changes_nothing() {
        std::thread::spawn(|| {
            lower_thread_priority(0).unwrap();
            let before = getpriority_process(None).unwrap();
            lower_thread_priority(0).unwrap();
            assert_eq!(getpriority_process(None).unwrap(), before);
            lower_thread_priority(MAX_NICE).unwrap();
            lower_thread_priority(MAX_NICE).unwrap();
            assert_eq!(getpriority_process(None).unwrap(), i32::from(MAX_NICE));
        })
        .join()
        .unwrap();
    }
}
