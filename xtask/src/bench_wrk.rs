//! `cargo xtask bench http --wrk`: `POST /select` driven by `wrk`, an established load
//! generator in C (Debian package `wrk`), against select-server and the ceiling server
//! (`--serve-ceiling`: reads each body, answers a constant) in alternating rounds of the
//! same invocation, so every figure comes with its ratio to what this machine's loopback,
//! hyper and the generator allow. Our own generator, a hyper client on one tokio thread,
//! costs more CPU per request than the ceiling server and so capped both at the same rate.
//!
//! wrk runs one thread (`-t1`): on two cores the other one is the server's. Unpinned, the
//! scheduler still moves them onto one core at times, and a server thread waiting behind wrk
//! shows up in the tail latency; `--pin` gives wrk a CPU of its own. Server CPU per request is
//! read from `/proc/<pid>/stat` around each round.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::bench_http::{PerfRecorder, ServerProcess};

/// The Lua script, kept next to this file.
const SCRIPT: &str = include_str!("bench_http_select.lua");

/// `--pin`: the CPUs this process may use, the last for wrk and the others for the servers.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pinning {
    /// A `taskset -c` list for both servers.
    pub(crate) servers: String,
    /// The one CPU wrk runs on.
    pub(crate) generator: String,
}

impl Pinning {
    /// Splits the CPUs in `/proc/self/status` (`Cpus_allowed_list`).
    pub(crate) fn split() -> Result<Self> {
        let status =
            std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .context("/proc/self/status has no Cpus_allowed_list (--pin needs Linux)")?;
        Self::from_list(list.trim())
    }

    /// `0-3,6` → servers `0,1,2,3`, generator `6`.
    fn from_list(list: &str) -> Result<Self> {
        let mut cpus = Vec::new();
        for part in list.split(',').filter(|p| !p.is_empty()) {
            let (lo, hi) = part.split_once('-').unwrap_or((part, part));
            let lo: u32 = lo
                .parse()
                .with_context(|| format!("bad CPU list {list:?}"))?;
            let hi: u32 = hi
                .parse()
                .with_context(|| format!("bad CPU list {list:?}"))?;
            cpus.extend(lo..=hi);
        }
        let Some((generator, servers)) = cpus.split_last().filter(|(_, s)| !s.is_empty()) else {
            bail!("--pin needs at least two CPUs, this process may use {list:?}");
        };
        let servers: Vec<String> = servers.iter().map(u32::to_string).collect();
        Ok(Self {
            servers: servers.join(","),
            generator: generator.to_string(),
        })
    }
}

/// One wrk round against one server.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Round {
    pub(crate) target: &'static str,
    pub(crate) connections: usize,
    pub(crate) requests: u64,
    pub(crate) seconds: f64,
    pub(crate) non_2xx: u64,
    pub(crate) socket_errors: u64,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    pub(crate) p999_us: u64,
    pub(crate) server_cpu_us_per_request: Option<f64>,
}

impl Round {
    fn rate(&self) -> f64 {
        self.requests as f64 / self.seconds.max(1e-9)
    }
}

/// Parses the script's `KVSELECT key=value ...` line out of wrk's output.
pub(crate) fn parse_summary(out: &str) -> Result<(u64, f64, u64, u64, u64, u64, u64)> {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("KVSELECT "))
        .context("wrk printed no KVSELECT summary line (did the script run?)")?;
    let get = |key: &str| -> Result<u64> {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
            .with_context(|| format!("wrk summary lacks {key}: {line}"))?
            .parse::<u64>()
            .with_context(|| format!("wrk summary {key} is not a number: {line}"))
    };
    Ok((
        get("requests")?,
        get("duration_us")? as f64 / 1e6,
        get("non2xx")?,
        get("socket_errors")?,
        get("p50")?,
        get("p99")?,
        get("p999")?,
    ))
}

/// Fails with install instructions when wrk is missing.
pub(crate) fn check_installed() -> Result<()> {
    match Command::new("wrk").arg("--version").output() {
        Ok(_) => Ok(()),
        Err(_) => bail!(
            "wrk is not installed; install it with `apt-get install wrk` (Debian/Ubuntu) or \
             from https://github.com/wg/wrk, then run this again"
        ),
    }
}

/// One round of `seconds` at `connections` against `server`.
fn round(
    target: &'static str,
    server: &ServerProcess,
    dir: &Path,
    connections: usize,
    seconds: u64,
    cpus: Option<&str>,
) -> Result<Round> {
    let script = dir.join("select.lua");
    let bodies = dir.join("bodies.jsonl");
    let url = format!("http://{}", server.addr);
    let cpu_before = server.cpu_time();
    let out = crate::bench_http::pinned("wrk".as_ref(), cpus)
        .args(["-t1", "-c", &connections.to_string(), "-d"])
        .arg(format!("{seconds}s"))
        .args(["--timeout", "10s", "-s"])
        .arg(&script)
        .arg(&url)
        .arg("--")
        .arg(&bodies)
        .output()
        .context("failed to run wrk")?;
    let cpu = server
        .cpu_time()
        .zip(cpu_before)
        .map(|(a, b)| a.saturating_sub(b));
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "wrk failed ({}): {}{}",
        out.status,
        text,
        String::from_utf8_lossy(&out.stderr)
    );
    let (requests, secs, non_2xx, socket_errors, p50_us, p99_us, p999_us) = parse_summary(&text)?;
    Ok(Round {
        target,
        connections,
        requests,
        seconds: secs,
        non_2xx,
        socket_errors,
        p50_us,
        p99_us,
        p999_us,
        server_cpu_us_per_request: cpu
            .filter(|_| requests > 0)
            .map(|c: Duration| c.as_secs_f64() * 1e6 / requests as f64),
    })
}

/// What [`run`] measures and how.
#[derive(Debug)]
pub(crate) struct Plan<'a> {
    pub(crate) connections: &'a [usize],
    pub(crate) seconds: u64,
    /// Rounds per target and connection count.
    pub(crate) rounds: usize,
    /// Where to write a profile of select-server's last round at the first count.
    pub(crate) perf: Option<&'a Path>,
    /// `taskset -c` CPUs for wrk (`--pin`).
    pub(crate) generator_cpus: Option<&'a str>,
}

/// Alternating rounds, `plan.rounds` per target and connection count, after a 1 s warm-up
/// each.
pub(crate) fn run(
    ours: &ServerProcess,
    ceiling: &ServerProcess,
    bodies: &[bytes::Bytes],
    plan: &Plan<'_>,
) -> Result<Vec<Round>> {
    let Plan {
        connections,
        seconds,
        rounds,
        perf,
        generator_cpus,
    } = *plan;
    let dir = crate::root().join("target/bench-http");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("select.lua"), SCRIPT).context("writing the wrk script")?;
    let mut lines = Vec::new();
    for b in bodies {
        ensure!(!b.contains(&b'\n'), "a request body spans lines");
        lines.extend_from_slice(b);
        lines.push(b'\n');
    }
    std::fs::write(dir.join("bodies.jsonl"), lines).context("writing the request bodies")?;
    let mut out = Vec::new();
    for (i, &c) in connections.iter().enumerate() {
        for (name, server) in [("select-server", ours), ("ceiling", ceiling)] {
            round(name, server, &dir, c, 1, generator_cpus)?;
        }
        for r in 0..rounds {
            for (name, server) in [("select-server", ours), ("ceiling", ceiling)] {
                eprintln!(
                    "xtask bench http --wrk: {name}, {c} connection(s), round {}",
                    r + 1
                );
                let profiled = i == 0 && r + 1 == rounds && name == "select-server";
                let recorder = match perf.filter(|_| profiled) {
                    Some(out) => Some(PerfRecorder::start(server.pid(), out, seconds)?),
                    None => None,
                };
                let got = round(name, server, &dir, c, seconds, generator_cpus)?;
                if let Some(recorder) = recorder {
                    recorder.finish()?;
                }
                ensure!(
                    got.non_2xx == 0 && got.socket_errors == 0,
                    "{name}: {} non-2xx answers and {} socket errors",
                    got.non_2xx,
                    got.socket_errors
                );
                out.push(got);
            }
        }
    }
    Ok(out)
}

/// The median; an even count averages the middle two.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Every round, then per connection count the medians and ours / ceiling.
pub(crate) fn table(rounds: &[Round]) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "| target | connections | req/s | p50 (µs) | p99 (µs) | p99.9 (µs) | non-2xx | server CPU µs/req |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in rounds {
        let cpu = r
            .server_cpu_us_per_request
            .map_or_else(|| "n/a".to_owned(), |c| format!("{c:.1}"));
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} | {} | {} | {} | {} | {cpu} |",
            r.target,
            r.connections,
            r.rate(),
            r.p50_us,
            r.p99_us,
            r.p999_us,
            r.non_2xx
        );
    }
    let mut counts: Vec<usize> = rounds.iter().map(|r| r.connections).collect();
    counts.dedup();
    s.push_str("\n| connections | median req/s ours | median req/s ceiling | ours / ceiling | median p99 ours (µs) | median p99 ceiling (µs) |\n| ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for c in counts {
        let pick = |t: &str, f: &dyn Fn(&Round) -> f64| {
            median(
                rounds
                    .iter()
                    .filter(|r| r.connections == c && r.target == t)
                    .map(f)
                    .collect(),
            )
        };
        let ours = pick("select-server", &Round::rate);
        let ceil = pick("ceiling", &Round::rate);
        let _ = writeln!(
            s,
            "| {c} | {ours:.0} | {ceil:.0} | {:.2} | {:.0} | {:.0} |",
            if ceil > 0.0 { ours / ceil } else { 0.0 },
            pick("select-server", &|r| r.p99_us as f64),
            pick("ceiling", &|r| r.p99_us as f64),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_gives_the_last_cpu_to_the_generator() {
        let p = Pinning::from_list("0-3,6").unwrap();
        assert_eq!((p.servers.as_str(), p.generator.as_str()), ("0,1,2,3", "6"));
        let p = Pinning::from_list("0-1").unwrap();
        assert_eq!((p.servers.as_str(), p.generator.as_str()), ("0", "1"));
        assert!(Pinning::from_list("5").is_err());
        assert!(Pinning::from_list("a-b").is_err());
    }

    #[test]
    fn the_summary_line_parses_and_its_absence_is_an_error() {
        let out = "Running 1s test\nKVSELECT requests=100 duration_us=2000000 non2xx=3 \
                   socket_errors=0 p50=400 p99=1900 p999=3000\n";
        assert_eq!(
            parse_summary(out).unwrap(),
            (100, 2.0, 3, 0, 400, 1900, 3000)
        );
        assert!(parse_summary("Running 1s test\n").is_err());
        assert!(parse_summary("KVSELECT requests=x").is_err());
    }

    #[test]
    fn the_table_gives_medians_and_the_ratio_to_the_ceiling() {
        let r = |target, requests| Round {
            target,
            connections: 16,
            requests,
            seconds: 1.0,
            non_2xx: 0,
            socket_errors: 0,
            p50_us: 1,
            p99_us: 2,
            p999_us: 3,
            server_cpu_us_per_request: Some(10.0),
        };
        let t = table(&[
            r("select-server", 30),
            r("ceiling", 100),
            r("select-server", 50),
            r("ceiling", 100),
            r("select-server", 40),
            r("ceiling", 80),
        ]);
        assert!(t.contains("| 16 | 40 | 100 | 0.40 | 2 | 2 |"), "{t}");
    }
}
