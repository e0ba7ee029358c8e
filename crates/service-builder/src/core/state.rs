//! The catalog state and the reservation index rows the core keeps.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::partition::Partition;
use crate::catalog::{PartitionKey, WorkerCatalogRecord};
use crate::session::BindingUpdate;

#[derive(Debug)]
pub(super) enum RowState {
    /// The id is claimed while a booking is in flight.
    Claimed,
    Booked,
}

#[derive(Debug)]
pub(super) struct ReservationRow {
    pub(super) partition: Arc<Partition>,
    pub(super) state: RowState,
    /// The session lease this booking holds, released with the row.
    pub(super) session: Option<String>,
}

impl ReservationRow {
    /// Releases the row's session lease; the binding, for peers, if it is still there.
    pub(super) fn release_session(&self, now: Instant) -> Option<BindingUpdate> {
        match (&self.session, &self.partition.sessions) {
            (Some(sid), Some(table)) => table.release(sid, now),
            _ => None,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) records: BTreeMap<u64, WorkerCatalogRecord>,
    pub(super) partitions: BTreeMap<PartitionKey, Arc<Partition>>,
}
