//! What a shard with a state directory keeps of its sessions' pages, and
//! how a Resume frame picks from it (see the "Kept pages" part of
//! `shard_runtime.proto`).
//!
//! Per session held for a coordinator, the chain of each full block the
//! coordinator named and the pages' hints as written to the log
//! ([`super::kept`]); and the detached sessions: ones no coordinator holds
//! now, taken back from the page file at start-up or left by a coordinator
//! that restarted. A Resume moves a session (held or detached) to the
//! coordinator asking, cut back to its longest run of first blocks whose
//! chains match; detached sessions give their pages back, oldest first,
//! when a held session needs pages the pool no longer has.

use std::collections::HashMap;
use std::sync::Arc;

use super::frame::WireSessionId;
use super::kept::{Identity, LoggedSession, Opened, StateDir};
use super::payload::Encoding;
use crate::durable::{hint_records, take_back_keyed, KeptHints, KeptRows, TakenBack};
use crate::kv::{KvError, KvPool, SessionKv};

/// A session's KV on a shard, keyed by the coordinator epoch that made it.
pub type SessionKey = (u64, WireSessionId);

/// What is known of one session's blocks.
#[derive(Debug)]
struct Kept {
    /// Exactly what the log holds of it.
    logged: LoggedSession,
    /// Each block's page key ([`Identity::page_key`] of its chain).
    keys: Vec<u64>,
    /// Its chains stopped making sense (a run arrived without them, or in
    /// another encoding): nothing more is kept of it until it starts over.
    broken: bool,
}

impl Kept {
    fn new(encoding: Encoding) -> Kept {
        Kept {
            logged: LoggedSession {
                encoding,
                chains: Vec::new(),
                hints: Vec::new(),
            },
            keys: Vec::new(),
            broken: false,
        }
    }

    fn truncate(&mut self, blocks: usize) {
        self.logged.chains.truncate(blocks);
        self.logged.hints.truncate(blocks);
        self.keys.truncate(blocks);
    }
}

/// A session no coordinator holds now.
#[derive(Debug)]
struct Detached {
    kv: SessionKv,
    kept: Kept,
    /// Detached order: the smallest gives its pages back first.
    since: u64,
}

/// What start-up took back from the state directory.
#[derive(Clone, Debug, Default)]
pub struct StartReport {
    pub sessions: usize,
    pub taken: TakenBack,
    pub refused: Option<String>,
    pub damaged_at: Option<usize>,
}

/// Verified pages of the log's sessions, claimed in the pool, waiting for
/// the pool to be shared ([`Keeper::new`]).
pub struct Verified {
    sessions: Vec<(WireSessionId, Kept, KeptRows)>,
    pub report: StartReport,
}

/// Checks every page the log names against `pool` (backed by the kept page
/// file, held by nobody yet) and claims those that verify.
pub fn verify(identity: &Identity, opened: Opened, pool: &mut KvPool) -> Result<Verified, KvError> {
    let sessions: Vec<(WireSessionId, Kept)> = opened
        .sessions
        .into_iter()
        .map(|(id, logged)| {
            let keys = logged
                .chains
                .iter()
                .map(|&c| identity.page_key(c, logged.encoding))
                .collect();
            let kept = Kept {
                logged,
                keys,
                broken: false,
            };
            (id, kept)
        })
        .collect();
    let hints: Vec<KeptHints<'_>> = sessions
        .iter()
        .map(|(_, kept)| KeptHints {
            keys: &kept.keys,
            hints: &kept.logged.hints,
        })
        .collect();
    let (rows, taken) = take_back_keyed(pool, &hints)?;
    let mut report = StartReport {
        sessions: 0,
        taken,
        refused: opened.refused,
        damaged_at: opened.damaged_at,
    };
    let sessions: Vec<_> = sessions
        .into_iter()
        .zip(rows)
        .filter(|(_, rows)| !rows.is_empty())
        .map(|((id, mut kept), rows)| {
            kept.truncate(rows.len());
            (id, kept, rows)
        })
        .collect();
    report.sessions = sessions.len();
    Ok(Verified { sessions, report })
}

/// See the module docs.
#[derive(Debug)]
pub struct Keeper {
    dir: StateDir,
    page_positions: usize,
    held: HashMap<SessionKey, Kept>,
    detached: HashMap<WireSessionId, Detached>,
    next_since: u64,
}

impl Keeper {
    /// Hands the verified pages to detached sessions of the shared pool,
    /// and rewrites the log to hold exactly them.
    pub fn new(mut dir: StateDir, verified: Verified, pool: &Arc<KvPool>) -> Keeper {
        let mut detached = HashMap::new();
        let mut since = 0;
        for (id, kept, rows) in verified.sessions {
            let mut kv = SessionKv::new(Arc::clone(pool));
            match kv.adopt_kept(&rows) {
                Ok(()) => {
                    since += 1;
                    detached.insert(id, Detached { kv, kept, since });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a kept session's pages could not be adopted");
                    let pages: Vec<u32> = rows
                        .iter()
                        .flat_map(|r| r.iter())
                        .flatten()
                        .copied()
                        .collect();
                    let _ = pool.allocator().free_many(&pages);
                }
            }
        }
        dir.rewrite(detached.iter().map(|(id, d)| (id, &d.kept.logged)));
        Keeper {
            dir,
            page_positions: pool.layout().page_positions,
            held: HashMap::new(),
            detached,
            next_since: since + 1,
        }
    }

    /// Sessions kept for no coordinator.
    pub fn detached(&self) -> usize {
        self.detached.len()
    }

    /// Positions the detached sessions hold.
    pub fn detached_positions(&self) -> usize {
        self.detached.values().map(|d| d.kv.len()).sum()
    }

    /// Notes a run the shard computed and committed for `key` (its session
    /// `kv` as it is now): `chains` names the blocks the run filled. Their
    /// pages' hints go to the log.
    pub fn record(
        &mut self,
        key: SessionKey,
        kv: &SessionKv,
        position: usize,
        rows: usize,
        chains: &[u64],
        encoding: Encoding,
    ) {
        let page = self.page_positions;
        let first = position / page;
        let filled = (position + rows) / page - first;
        let kept = self.held.entry(key).or_insert_with(|| Kept::new(encoding));
        if position == 0 {
            *kept = Kept::new(encoding);
        }
        if filled == 0 {
            return;
        }
        if kept.broken
            || chains.len() != filled
            || kept.logged.encoding != encoding
            || kept.keys.len() != first
        {
            if !kept.broken && !kept.keys.is_empty() {
                self.dir.log_cut(&key.1, 0);
            }
            kept.broken = true;
            kept.truncate(0);
            return;
        }
        let identity = *self.dir.identity();
        kept.logged.chains.extend_from_slice(chains);
        kept.keys
            .extend(chains.iter().map(|&c| identity.page_key(c, encoding)));
        let Some(records) = hint_records(kv, &kept.keys, first) else {
            kept.broken = true;
            kept.truncate(0);
            return;
        };
        for hints in records {
            let from = hints.first_block as usize;
            let to = from + hints.blocks.len();
            kept.logged.hints.extend(hints.blocks.iter().cloned());
            self.dir
                .log_blocks(&key.1, encoding, &kept.logged.chains[from..to], &hints);
        }
        self.maybe_rewrite();
    }

    /// A session is gone (released by its coordinator, or its frame stopped
    /// midway): forget its blocks, and free a detached session of that id.
    pub fn forget(&mut self, key: SessionKey) {
        let logged = self.held.remove(&key).is_some_and(|k| !k.keys.is_empty());
        let detached = self.detached.remove(&key.1);
        let was_detached = detached.is_some();
        if let Some(mut d) = detached {
            let _ = d.kv.release();
        }
        if logged || was_detached {
            self.dir.log_cut(&key.1, 0);
        }
    }

    /// A coordinator that held `key` restarted: keep the session's full
    /// blocks for whoever resumes it.
    pub fn detach(&mut self, key: SessionKey, mut kv: SessionKv) {
        let page = self.page_positions;
        let kept = self.held.remove(&key);
        let usable = kept.filter(|k| !k.broken && !k.keys.is_empty());
        let Some(mut kept) = usable else {
            let _ = kv.release();
            return;
        };
        let blocks = kept.keys.len().min(kv.len() / page);
        if blocks == 0 || kv.cut_back_to(blocks * page).is_err() {
            let _ = kv.release();
            self.dir.log_cut(&key.1, 0);
            return;
        }
        if blocks < kept.keys.len() {
            kept.truncate(blocks);
            self.dir.log_cut(&key.1, blocks);
        }
        if let Some(mut old) = self.detached.remove(&key.1) {
            let _ = old.kv.release();
        }
        self.next_since += 1;
        self.detached.insert(
            key.1,
            Detached {
                kv,
                kept,
                since: self.next_since,
            },
        );
    }

    /// Answers a Resume from coordinator `key.0`: `held` is what the shard
    /// holds of the session for it, if anything. Returns the session to
    /// hold (cut back to the blocks whose chains match `offered`, computed
    /// from hidden states in `encoding`) and the positions it keeps.
    pub fn resume(
        &mut self,
        key: SessionKey,
        held: Option<SessionKv>,
        offered: &[u64],
        encoding: Encoding,
    ) -> (Option<SessionKv>, usize) {
        let page = self.page_positions;
        let found = match held {
            Some(kv) => Some((kv, self.held.remove(&key))),
            None => self.detached.remove(&key.1).map(|d| (d.kv, Some(d.kept))),
        };
        let Some((mut kv, kept)) = found else {
            return (None, 0);
        };
        let usable = kept.filter(|k| !k.broken && k.logged.encoding == encoding);
        let blocks = usable.as_ref().map_or(0, |k| {
            k.logged
                .chains
                .iter()
                .zip(offered)
                .take_while(|(a, b)| a == b)
                .count()
                .min(kv.len() / page)
        });
        let cut = blocks > 0 && kv.cut_back_to(blocks * page).is_ok();
        let (Some(mut kept), true) = (usable, cut) else {
            let _ = kv.release();
            self.dir.log_cut(&key.1, 0);
            return (None, 0);
        };
        if blocks < kept.keys.len() {
            kept.truncate(blocks);
            self.dir.log_cut(&key.1, blocks);
        }
        self.held.insert(key, kept);
        (Some(kv), blocks * page)
    }

    /// Frees the detached session detached longest ago; `false` when none is.
    pub fn free_oldest_detached(&mut self) -> bool {
        let Some(id) = self
            .detached
            .iter()
            .min_by_key(|(_, d)| d.since)
            .map(|(id, _)| *id)
        else {
            return false;
        };
        if let Some(mut d) = self.detached.remove(&id) {
            let _ = d.kv.release();
        }
        self.dir.log_cut(&id, 0);
        true
    }

    /// Rewrites the log once it holds more than twice what it must (looked
    /// at only when [`StateDir::due`]: the log grew since the last look).
    fn maybe_rewrite(&mut self) {
        if !self.dir.due() {
            return;
        }
        let needed: u64 = self
            .held
            .values()
            .chain(self.detached.values().map(|d| &d.kept))
            .map(|k| StateDir::bytes_for(&k.logged))
            .sum();
        if self.dir.wants_rewrite(needed) {
            let sessions = self
                .held
                .iter()
                .map(|(key, k)| (&key.1, &k.logged))
                .chain(self.detached.iter().map(|(id, d)| (id, &d.kept.logged)));
            self.dir.rewrite(sessions);
        }
    }
}
