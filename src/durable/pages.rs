//! KV pages that outlive the process. With a state directory the page pool
//! is a file there (`kv.pages`), so after a restart, clean or killed, the
//! pages a session held are still in it, unless another session was given
//! them since. The journals say where each full page was (Pages hints); a
//! restart takes a page back only if its bytes hash to the checksum the hint
//! carries, and every other position is computed again from the history.
//!
//! A checksum binds a page's bytes to everything they depend on: the tokens
//! up to the page's end (a hash chain over the history's blocks) and the
//! layer. A page rewritten for another history, torn by a crash, flipped on
//! disk or hinted by a stale record fails its check, so a restored session
//! holds exactly the bits a cold prefill of its history computes
//! (CONTRACT §2.2), which is what makes taking pages back safe at all.

use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::journal::{PageHint, PageHints, MAX_HINTS_PER_RECORD};
use super::Recovered;
use crate::kv::{KvError, KvPool, SessionKv};

/// The chain's value before the first block.
const CHAIN_START: u64 = 0x696e_6665_7264_6b76;

/// The chain hash after each of the first `blocks` blocks of `history`
/// (`page_positions` tokens each): entry `b` covers `history[..(b + 1) *
/// page_positions]`.
pub fn chain(history: &[u32], page_positions: usize, blocks: usize) -> Vec<u64> {
    let mut chain = Vec::with_capacity(blocks);
    let end = (blocks * page_positions).min(history.len());
    extend_chain(&mut chain, &history[..end], page_positions);
    chain
}

/// Extends `chain` by the hash of each full block of `rest`: the tokens
/// that follow the blocks `chain` covers.
pub fn extend_chain(chain: &mut Vec<u64>, rest: &[u32], page_positions: usize) {
    let mut at = chain.last().copied().unwrap_or(CHAIN_START);
    for block in rest.chunks_exact(page_positions) {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        at = xxh3_64_with_seed(&bytes, at);
        chain.push(at);
    }
}

/// The seed a page of `layer` is hashed under, for a block whose chain hash
/// is `chain`.
pub fn layer_seed(chain: u64, layer: usize) -> u64 {
    xxh3_64_with_seed(&(layer as u64).to_le_bytes(), chain)
}

/// The hints for blocks `from..chain.len()` of a session's history, split
/// into records of at most [`MAX_HINTS_PER_RECORD`] hints, or `None` when a
/// block is not all committed in `kv`.
pub fn hint_records(kv: &SessionKv, chain: &[u64], from: usize) -> Option<Vec<PageHints>> {
    let n_layers = kv.pool().layout().n_layers;
    let per_record = (MAX_HINTS_PER_RECORD / n_layers).max(1);
    let mut records = Vec::new();
    for start in (from..chain.len()).step_by(per_record) {
        let end = (start + per_record).min(chain.len());
        let blocks = (start..end)
            .map(|block| {
                let row = kv.block_checksums(block, |layer| layer_seed(chain[block], layer))?;
                Some(
                    row.iter()
                        .map(|entry| match *entry {
                            Some((page, checksum)) => PageHint { page, checksum },
                            None => PageHint {
                                page: PageHint::ABSENT,
                                checksum: 0,
                            },
                        })
                        .collect(),
                )
            })
            .collect::<Option<Vec<Box<[PageHint]>>>>()?;
        records.push(PageHints {
            first_block: start as u32,
            n_layers: n_layers as u32,
            blocks,
        });
    }
    Some(records)
}

/// What taking pages back found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TakenBack {
    /// Page references handed to restored sessions.
    pub pages: usize,
    /// Positions those pages hold, summed over the sessions.
    pub positions: usize,
    /// Hinted pages whose bytes did not match (or that lie outside the
    /// pool): computed again.
    pub rejected: usize,
}

/// Verifies every recovered session's hinted pages in `pool` (a pool no
/// session holds yet, backed by the kept page file), fills in each
/// session's `pages` with the longest run of blocks it can take back, and
/// claims those pages in the pool's allocator, one reference per session
/// that holds each.
///
/// A session takes back blocks only below the block of its last token:
/// that token is always fed again, since its logits are the session's
/// state too. A sliding-window layer needs only the pages its window still
/// sees at the restored length; the others need every page.
pub fn take_back(pool: &mut KvPool, sessions: &mut [Recovered]) -> Result<TakenBack, KvError> {
    let page = pool.layout().page_positions;
    let chains: Vec<Vec<u64>> = sessions
        .iter()
        .map(|session| match session.history.len().checked_sub(1) {
            Some(last) => chain(
                &session.history,
                page,
                (last / page).min(session.hints.len()),
            ),
            None => Vec::new(),
        })
        .collect();
    let kept: Vec<KeptHints<'_>> = sessions
        .iter()
        .zip(&chains)
        .map(|(session, keys)| KeptHints {
            keys,
            hints: &session.hints,
        })
        .collect();
    let (rows, report) = take_back_keyed(pool, &kept)?;
    for (session, rows) in sessions.iter_mut().zip(rows) {
        session.pages = rows;
    }
    Ok(report)
}

/// The hints of one history's first blocks, and the key each block's
/// checksums are seeded by (its chain hash, or what a shard derives from
/// it); only blocks that have both are looked at.
pub struct KeptHints<'a> {
    pub keys: &'a [u64],
    pub hints: &'a [Box<[PageHint]>],
}

/// Taken-back pages of one history: one row per block from block 0, one
/// entry per layer (`None`: a window layer's page no later position reads).
pub type KeptRows = Vec<Box<[Option<u32>]>>;

/// [`take_back`] for histories named by their keys: verifies each one's
/// hinted pages in `pool` (held by no session yet), returns per history
/// the longest run of blocks it takes back, and claims those pages, one
/// reference per history that holds each.
pub fn take_back_keyed(
    pool: &mut KvPool,
    histories: &[KeptHints<'_>],
) -> Result<(Vec<KeptRows>, TakenBack), KvError> {
    let mut report = TakenBack::default();
    if !pool.holds_rows() {
        return Ok((histories.iter().map(|_| Vec::new()).collect(), report));
    }
    let layout = *pool.layout();
    let page = layout.page_positions;
    let windows: Vec<Option<usize>> = (0..layout.n_layers).map(|l| pool.layer_window(l)).collect();
    let total = pool.total_pages();
    let mut refs = vec![0u32; total];
    // Shared pages (forks, shared prefixes) are hinted by every holder.
    let mut checked: HashMap<(u32, u64), Option<u64>> = HashMap::new();
    let mut taken = Vec::with_capacity(histories.len());
    for history in histories {
        let most = history.keys.len().min(history.hints.len());
        let chain = history.keys;
        // Per block, per layer: the page, if its bytes verify.
        let mut verified: Vec<Vec<Option<u32>>> = Vec::with_capacity(most);
        for (block, hints) in history.hints.iter().take(most).enumerate() {
            if hints.len() != layout.n_layers {
                break;
            }
            let row: Vec<Option<u32>> = hints
                .iter()
                .enumerate()
                .map(|(layer, hint)| {
                    if hint.page == PageHint::ABSENT || hint.page as usize >= total {
                        return None;
                    }
                    let seed = layer_seed(chain[block], layer);
                    let sum = *checked
                        .entry((hint.page, seed))
                        .or_insert_with(|| pool.checksum_unheld_page(hint.page, seed));
                    (sum == Some(hint.checksum)).then_some(hint.page)
                })
                .collect();
            let bad = hints
                .iter()
                .zip(&row)
                .filter(|(h, v)| h.page != PageHint::ABSENT && v.is_none())
                .count();
            report.rejected += bad;
            // A layer that sees every position needs every block.
            if row
                .iter()
                .zip(&windows)
                .any(|(v, w)| v.is_none() && w.is_none())
            {
                break;
            }
            verified.push(row);
        }
        let blocks = longest_run(0, verified.len(), &windows, page, |b, layer| {
            verified[b][layer].is_some()
        });
        let rows: Vec<Box<[Option<u32>]>> = verified
            .iter()
            .take(blocks)
            .enumerate()
            .map(|(block, row)| {
                row.iter()
                    .zip(&windows)
                    .map(|(&held, window)| match window {
                        Some(w) if block < first_seen_block(blocks * page, *w, page) => None,
                        _ => held,
                    })
                    .collect()
            })
            .collect();
        for &p in rows.iter().flat_map(|r| r.iter()).flatten() {
            refs[p as usize] += 1;
            report.pages += 1;
        }
        report.positions += blocks * page;
        taken.push(rows);
    }
    pool.claim_pages(&refs)?;
    Ok((taken, report))
}

/// The first block a layer with a window of `window` positions still reads
/// when the next position fed is `len`.
pub(super) fn first_seen_block(len: usize, window: usize, page: usize) -> usize {
    (len + 1).saturating_sub(window) / page
}

/// The most blocks `k` in `start..=most` such that, for every block from
/// `start` to `k`, every layer `has` its page, except window layers for
/// blocks their window no longer reads once `k` blocks are held.
pub(super) fn longest_run(
    start: usize,
    most: usize,
    windows: &[Option<usize>],
    page: usize,
    has: impl Fn(usize, usize) -> bool,
) -> usize {
    (start..=most)
        .rev()
        .find(|&blocks| {
            (start..blocks).all(|b| {
                windows
                    .iter()
                    .enumerate()
                    .all(|(layer, window)| match window {
                        Some(w) if b < first_seen_block(blocks * page, *w, page) => true,
                        _ => has(b, layer),
                    })
            })
        })
        .unwrap_or(start)
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::base::{SessionId, Tenant};
    use crate::durable::{Durability, SessionStore};
    use crate::kv::{KvBacking, KvLayout, KvPoolConfig};

    const PAGE: usize = 4;
    const LAYERS: usize = 3;

    fn open_pool(file: &Path, windows: &[Option<usize>]) -> KvPool {
        let pool = KvPool::new(KvPoolConfig {
            layout: KvLayout {
                n_layers: LAYERS,
                kv_dim: 8,
                page_positions: PAGE,
            },
            n_pages: 120,
            backing: KvBacking::Kept(file.to_owned()),
            prefault: false,
        })
        .expect("pool");
        if windows.is_empty() {
            pool
        } else {
            pool.with_layer_windows(windows.to_vec())
                .expect("windows")
                .with_window_slack(PAGE)
        }
    }

    /// A value that depends on the history up to `pos` (as real KV does).
    fn row(history: &[u32], layer: usize, pos: usize) -> Vec<f32> {
        let sum: u32 = history[..=pos].iter().sum();
        (0..8)
            .map(|i| (sum as f32) * 0.25 + (layer * 8 + i) as f32)
            .collect()
    }

    /// Computes `history` into a session of `pool`, settles it, and
    /// journals it with its page hints.
    fn compute(pool: &Arc<KvPool>, store: &SessionStore, history: &[u32]) -> SessionKv {
        let mut kv = SessionKv::new(Arc::clone(pool));
        kv.reserve(history.len()).unwrap();
        for pos in 0..history.len() {
            for layer in 0..LAYERS {
                let r = row(history, layer, pos);
                kv.write(layer, pos, &r, &r).unwrap();
            }
        }
        kv.commit(history.len()).unwrap();
        kv.settle().unwrap();
        let id = SessionId::random().unwrap();
        let mut journal = store.create(id, "t", &[], &Tenant::NONE, history).unwrap();
        let full = history.len() / PAGE;
        let chain = chain(history, PAGE, full);
        for hints in hint_records(&kv, &chain, 0).expect("all committed") {
            journal.hint_pages(&hints).unwrap();
        }
        kv
    }

    /// The pages of `kv` per block, as `take_back` reports them.
    fn rows_of(kv: &SessionKv, blocks: usize) -> Vec<Box<[Option<u32>]>> {
        (0..blocks)
            .map(|b| {
                kv.block_checksums(b, |_| 0)
                    .unwrap()
                    .iter()
                    .map(|e| e.map(|(page, _)| page))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn pages_that_verify_come_back_claimed_and_damaged_ones_are_left() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kv.pages");
        let history: Vec<u32> = (0..23).map(|i| i * 3 + 1).collect();
        let shorter: Vec<u32> = history[..12].to_vec();
        let (expected, expected_short) = {
            let store = SessionStore::open(dir.path(), [1; 32], Durability::None).unwrap();
            let pool = Arc::new(open_pool(&file, &[]));
            let a = compute(&pool, &store, &history);
            let b = compute(&pool, &store, &shorter);
            // Blocks below the last token's block: 22 / 4 = 5, and 11 / 4 = 2.
            (rows_of(&a, 5), rows_of(&b, 2))
        };
        let store = SessionStore::open(dir.path(), [1; 32], Durability::None).unwrap();
        let (mut sessions, refused) = store.recover(1000, 1000);
        assert!(refused.is_empty());
        sessions.sort_by_key(|s| s.history.len());
        let mut pool = open_pool(&file, &[]);
        let found = take_back(&mut pool, &mut sessions).unwrap();
        assert_eq!(sessions[0].pages, expected_short);
        assert_eq!(sessions[1].pages, expected);
        assert_eq!(
            found,
            TakenBack {
                pages: 21,
                positions: 28,
                rejected: 0
            }
        );
        // Claimed: a pool of 120 pages has 21 held.
        assert_eq!(pool.free_pages(), 120 - 21);
        let held = expected[1][2].unwrap();
        assert_eq!(pool.allocator().references(held).unwrap(), 1);
        drop(pool);

        // One byte of one page of block 1 flipped: the long session stops
        // at block 1 (every layer here sees every position).
        let mut bytes = std::fs::read(&file).unwrap();
        let stride = KvLayout {
            n_layers: LAYERS,
            kv_dim: 8,
            page_positions: PAGE,
        }
        .page_stride();
        bytes[held as usize * stride + 17] ^= 1;
        std::fs::write(&file, bytes).unwrap();
        for s in &mut sessions {
            s.pages.clear();
        }
        let mut pool = open_pool(&file, &[]);
        let found = take_back(&mut pool, &mut sessions).unwrap();
        assert_eq!(sessions[1].pages, expected[..1].to_vec());
        assert_eq!(sessions[0].pages, expected_short);
        assert_eq!(found.rejected, 1);
        assert_eq!(found.pages, 2 * LAYERS + LAYERS);
    }

    #[test]
    fn a_window_layer_needs_only_the_pages_its_window_still_sees() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("kv.pages");
        let windows = [None, Some(6), None];
        let history: Vec<u32> = (0..30).map(|i| i * 5 + 2).collect();
        let live = {
            let store = SessionStore::open(dir.path(), [1; 32], Durability::None).unwrap();
            let pool = Arc::new(open_pool(&file, &windows));
            let kv = compute(&pool, &store, &history);
            rows_of(&kv, 7)
        };
        // Settled at 30 with a window of 6 and a slack of a page: layer 1
        // holds blocks 5 to 7 only.
        assert_eq!(live.iter().filter(|r| r[1].is_some()).count(), 2);
        let store = SessionStore::open(dir.path(), [1; 32], Durability::None).unwrap();
        let (mut sessions, _) = store.recover(1000, 1000);
        let mut pool = open_pool(&file, &windows);
        take_back(&mut pool, &mut sessions).unwrap();
        // 29 / 4 = 7 blocks; feeding from 28 on, the window reads from 23
        // on (block 5), which the slack kept.
        let got = &sessions[0].pages;
        let blocks = got.len();
        assert_eq!(blocks, 7);
        let first_seen = (blocks * PAGE + 1).saturating_sub(6) / PAGE;
        for (b, row) in got.iter().enumerate() {
            assert_eq!(row[0], live[b][0]);
            assert_eq!(row[2], live[b][2]);
            if b < first_seen {
                assert_eq!(row[1], None, "block {b}");
            } else {
                assert_eq!(row[1], live[b][1], "block {b}");
                assert!(row[1].is_some());
            }
        }
        // The session can hold them: the window layer's gap is a prefix.
        let pool = Arc::new(pool);
        let mut kv = SessionKv::new(Arc::clone(&pool));
        kv.adopt_kept(got).unwrap();
        assert_eq!(kv.len(), blocks * PAGE);
        for pos in first_seen * PAGE..kv.len() {
            let want: Vec<half::f16> = row(&history, 1, pos)
                .iter()
                .map(|&x| half::f16::from_f32(x))
                .collect();
            assert_eq!(kv.k(1, pos).unwrap(), &want[..], "pos {pos}");
        }
        drop(kv);
        assert_eq!(pool.free_pages(), pool.total_pages());
    }
}
