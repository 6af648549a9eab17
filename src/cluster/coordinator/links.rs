//! A chain's links to its shards: connecting them (with back-off), what a
//! failure does to a link, and releases and cancels sent to every shard.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{FailureKind, ShardChain, ShardFailure};
use crate::cluster::frame::{ErrorKind, WireSessionId};
use crate::cluster::link::{LinkError, ShardLink};

/// After a connect refused at once, steps fail at once for this long
/// before the next try; after one that hung (an unreachable host), for
/// [`SLOW_RECONNECT_BACKOFF`], so that steps do not each wait out a
/// handshake timeout.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(200);
const SLOW_RECONNECT_BACKOFF: Duration = Duration::from_secs(2);

impl ShardChain {
    pub(super) fn failure(&mut self, index: usize, error: &LinkError) -> ShardFailure {
        let kind = FailureKind::of(error);
        let counters = &self.plan.stats.shards[index];
        counters.failures[kind.index()].fetch_add(1, Ordering::Relaxed);
        let broken = match kind {
            FailureKind::Transport | FailureKind::Handshake => true,
            FailureKind::Protocol(k) => {
                matches!(error, LinkError::BadReply { .. })
                    || matches!(k, ErrorKind::StaleEpoch | ErrorKind::Sequence)
            }
        };
        if broken {
            counters.up.store(false, Ordering::Relaxed);
            let slot = &mut self.slots[index];
            slot.link = None;
            slot.last_error = error.to_string();
        }
        let shard = self.plan.shards[index].label();
        tracing::warn!(%shard, kind = kind.name(), %error, "shard step failed");
        ShardFailure {
            shard,
            kind,
            message: error.to_string(),
        }
    }

    /// Connects every link that is down (a shard whose epoch changed has
    /// lost every session: the lineage moves on).
    pub(super) fn connect_all(&mut self) -> Result<(), ShardFailure> {
        for index in 0..self.slots.len() {
            if self.slots[index].link.is_some() {
                continue;
            }
            let shard = &self.plan.shards[index];
            let now = Instant::now();
            if now < self.slots[index].next_try {
                return Err(ShardFailure {
                    shard: shard.label(),
                    kind: FailureKind::Transport,
                    message: format!(
                        "the shard is unreachable ({}); next try in {} ms",
                        self.slots[index].last_error,
                        (self.slots[index].next_try - now).as_millis()
                    ),
                });
            }
            let connected = ShardLink::connect_in(
                &self.plan.env,
                &shard.addr,
                &shard.fingerprint,
                self.plan.coordinator_epoch,
                &self.plan.options,
            );
            let mut link = match connected {
                Ok(link) => link,
                Err(e) => {
                    let waited = now.elapsed();
                    self.slots[index].next_try = Instant::now()
                        + if waited < Duration::from_millis(500) {
                            RECONNECT_BACKOFF
                        } else {
                            SLOW_RECONNECT_BACKOFF
                        };
                    return Err(self.failure(index, &e));
                }
            };
            let counters = &self.plan.stats.shards[index];
            counters.set_backend(link.capacity().backend);
            let epoch = link.epochs().shard;
            let slot = &mut self.slots[index];
            match slot.epoch {
                Some(old) if old != epoch => {
                    counters.restarts.fetch_add(1, Ordering::Relaxed);
                    counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(shard = %shard.label(), "the shard restarted: its sessions will be rebuilt");
                    self.lineage += 1;
                    // Only this shard lost everything; the others still
                    // hold what they are owed releases for.
                    slot.owed_release.clear();
                }
                Some(_) => {
                    counters.reconnects.fetch_add(1, Ordering::Relaxed);
                    let owed: Vec<WireSessionId> = slot.owed_release.iter().copied().collect();
                    if !owed.is_empty() {
                        if let Err(e) = link.release(&owed) {
                            return Err(self.failure(index, &e));
                        }
                        slot.owed_release.clear();
                    }
                }
                None => {}
            }
            counters.up.store(true, Ordering::Relaxed);
            let slot = &mut self.slots[index];
            slot.epoch = Some(epoch);
            slot.link = Some(link);
        }
        Ok(())
    }

    /// Frees sessions on every shard: now where the link is up, when it
    /// comes back otherwise.
    pub fn release(&mut self, sessions: &[WireSessionId]) {
        for id in sessions {
            self.held.remove(id);
            self.chains.remove(id);
        }
        for index in 0..self.slots.len() {
            let sent = match self.slots[index].link.as_mut() {
                Some(link) => link.release(sessions).map_err(Some),
                None => Err(None),
            };
            match sent {
                Ok(()) => {}
                Err(error) => {
                    if let Some(e) = error {
                        self.failure(index, &e);
                    }
                    self.slots[index]
                        .owed_release
                        .extend(sessions.iter().copied());
                }
            }
        }
    }

    /// Tells every shard the sessions' generations were cancelled.
    pub fn cancel(&mut self, sessions: &[WireSessionId]) {
        for index in 0..self.slots.len() {
            if let Some(Err(e)) = self.slots[index]
                .link
                .as_mut()
                .map(|link| link.cancel(sessions))
            {
                self.failure(index, &e);
            }
        }
    }

    pub(super) fn link_down(&self, index: usize) -> ShardFailure {
        ShardFailure {
            shard: self.plan.shards[index].label(),
            kind: FailureKind::Transport,
            message: "the link is down".into(),
        }
    }

    /// Whether each shard keeps pages (a link that is down counts as one
    /// that does not).
    pub(super) fn keeping_pages(&self) -> impl Iterator<Item = bool> + '_ {
        self.slots
            .iter()
            .map(|s| s.link.as_ref().is_some_and(|l| l.capacity().keeps_pages))
    }

    /// Positions per page, as the shards agreed at the handshake.
    pub(super) fn page_positions(&self) -> usize {
        self.slots
            .iter()
            .filter_map(|s| s.link.as_ref())
            .map(|l| l.capacity().page_positions as usize)
            .next()
            .unwrap_or(1)
            .max(1)
    }
}
