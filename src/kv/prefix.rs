//! The shared-prefix index: full KV pages some session computed, found again
//! by the exact token ids before and in them, so that a session whose
//! history starts with the same tokens maps those pages instead of computing
//! them again. The KV of a history is a pure function of its tokens
//! (CONTRACT §2.2), so a mapped page holds exactly the bits the session
//! would have computed itself.
//!
//! The index is a trie of pages: an entry is one page of positions (one
//! pool page per layer) keyed by its parent entry and its own tokens, so a
//! match is exact, token for token, never a hash that could collide.
//!
//! The index holds one reference on every page it lists (the allocator
//! counts holders), so a listed page is never reused while listed, whoever
//! else lets go of it; a session mapping pages takes its own references
//! under the index's lock, so an entry cannot be dropped halfway through.
//! Pages that only the index still holds are the prefix cache: at most
//! `cache_pages` of them are kept, the least recently used leaves dropped
//! first (an entry is never dropped before its children), and all of them
//! give way when the pool is short ([`PrefixIndex::reclaim`]).
//!
//! One mutex guards the trie. It is taken when a session starts an append
//! on a page boundary, when a session's page fills, when a session goes and
//! when pages are short; never per token.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::error::KvError;
use super::pool::KvPool;

/// An entry of the trie; [`PrefixIndex::ROOT`] is the empty prefix.
pub type EntryId = u64;

/// One listed page of positions.
struct Entry {
    parent: EntryId,
    tokens: Box<[u32]>,
    /// One pool page per layer.
    pages: Box<[u32]>,
    children: usize,
    /// The trie's clock when it was last inserted or matched.
    used: u64,
}

#[derive(Default)]
struct Trie {
    entries: HashMap<EntryId, Entry>,
    /// `(parent, tokens)` to the entry: the exact key.
    children: HashMap<(EntryId, Box<[u32]>), EntryId>,
    last_id: EntryId,
    clock: u64,
}

/// Pages matched for a session: one pool page per layer for each matched
/// page of positions, each with a reference taken for the session.
#[derive(Debug, Default)]
pub struct PrefixMatch {
    /// The entry of the last matched page (the start when none matched).
    pub entry: EntryId,
    pub pages: Vec<Box<[u32]>>,
}

/// What the index holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Pages of positions listed.
    pub entries: usize,
    /// Pool pages only the index holds (the cache).
    pub cached_pages: usize,
}

/// The shared-prefix index of one pool.
pub struct PrefixIndex {
    pool: Arc<KvPool>,
    cache_pages: usize,
    trie: Mutex<Trie>,
}

impl PrefixIndex {
    /// The empty prefix: every chain starts here.
    pub const ROOT: EntryId = 0;

    /// An empty index over `pool`'s pages that keeps at most `cache_pages`
    /// pages no session holds.
    pub fn new(pool: Arc<KvPool>, cache_pages: usize) -> Self {
        PrefixIndex {
            pool,
            cache_pages,
            trie: Mutex::new(Trie::default()),
        }
    }

    /// Positions per listed page.
    pub fn page_positions(&self) -> usize {
        self.pool.layout().page_positions
    }

    fn lock(&self) -> MutexGuard<'_, Trie> {
        // A panic while holding the lock leaves the trie as consistent as
        // between two calls (every change is one insert or one removal).
        self.trie
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Matches the full pages of `tokens` (at most `most` of them) after
    /// entry `from`, taking a reference on every matched pool page for the
    /// caller. An entry that no longer exists matches nothing.
    pub fn lookup(
        &self,
        from: EntryId,
        tokens: &[u32],
        most: usize,
    ) -> Result<PrefixMatch, KvError> {
        let page = self.page_positions();
        let allocator = self.pool.allocator();
        let mut trie = self.lock();
        trie.clock += 1;
        let now = trie.clock;
        let mut found = PrefixMatch {
            entry: from,
            pages: Vec::new(),
        };
        if from != Self::ROOT && !trie.entries.contains_key(&from) {
            return Ok(found);
        }
        for chunk in tokens.chunks_exact(page).take(most) {
            let Some(&id) = trie.children.get(&(found.entry, Box::from(chunk))) else {
                break;
            };
            let Some(entry) = trie.entries.get_mut(&id) else {
                break;
            };
            entry.used = now;
            for (k, &p) in entry.pages.iter().enumerate() {
                if let Err(err) = allocator.share(p) {
                    // Give back what this call took: nothing changed.
                    let _ = allocator.free_many(&entry.pages[..k]);
                    for taken in &found.pages {
                        let _ = allocator.free_many(taken);
                    }
                    return Err(err);
                }
            }
            found.pages.push(entry.pages.clone());
            found.entry = id;
        }
        Ok(found)
    }

    /// Lists the page of positions after entry `parent` holding `tokens`
    /// with pool `pages` (one per layer), taking the index's reference on
    /// them; an equal entry already listed is kept and returned instead.
    /// `None` when `parent` is no longer listed (the chain was dropped).
    pub fn insert(
        &self,
        parent: EntryId,
        tokens: &[u32],
        pages: &[u32],
    ) -> Result<Option<EntryId>, KvError> {
        let mut trie = self.lock();
        trie.clock += 1;
        let now = trie.clock;
        if parent != Self::ROOT && !trie.entries.contains_key(&parent) {
            return Ok(None);
        }
        let key = (parent, Box::<[u32]>::from(tokens));
        if let Some(&id) = trie.children.get(&key) {
            if let Some(entry) = trie.entries.get_mut(&id) {
                entry.used = now;
            }
            return Ok(Some(id));
        }
        let allocator = self.pool.allocator();
        for (k, &p) in pages.iter().enumerate() {
            if let Err(err) = allocator.share(p) {
                let _ = allocator.free_many(&pages[..k]);
                return Err(err);
            }
        }
        trie.last_id += 1;
        let id = trie.last_id;
        if let Some(up) = trie.entries.get_mut(&parent) {
            up.children += 1;
        }
        trie.entries.insert(
            id,
            Entry {
                parent,
                tokens: key.1.clone(),
                pages: pages.into(),
                children: 0,
                used: now,
            },
        );
        trie.children.insert(key, id);
        // No trim here: the caller holds these pages, so listing them adds
        // nothing to the cache (pages only join it when sessions let go).
        Ok(Some(id))
    }

    /// Drops cached pages beyond the budget: called after a session let go
    /// of pages (its removal or spill), the only way pages join the cache.
    /// Pages a rollback or truncation let go wait for the next call, or are
    /// reclaimed first when the pool is short.
    pub fn trim(&self) {
        let mut trie = self.lock();
        self.trim_locked(&mut trie, self.cache_pages, usize::MAX);
    }

    /// Frees up to `wanted` pool pages the cache holds, least recently used
    /// first, whatever the budget: the pool is short. Returns the pages
    /// freed.
    pub fn reclaim(&self, wanted: usize) -> usize {
        let mut trie = self.lock();
        self.trim_locked(&mut trie, 0, wanted)
    }

    /// What the index holds now.
    pub fn stats(&self) -> PrefixStats {
        let trie = self.lock();
        PrefixStats {
            entries: trie.entries.len(),
            cached_pages: trie
                .entries
                .values()
                .map(|e| self.pages_only_listed(e))
                .sum(),
        }
    }

    /// Pool pages of `entry` nobody but the index holds.
    fn pages_only_listed(&self, entry: &Entry) -> usize {
        let allocator = self.pool.allocator();
        entry
            .pages
            .iter()
            .filter(|&&p| allocator.references(p).is_ok_and(|n| n <= 1))
            .count()
    }

    /// Drops least recently used leaf entries that no session holds any
    /// page of, while more than `budget` such pages are cached, freeing at
    /// most `most` pool pages. Returns the pages freed.
    fn trim_locked(&self, trie: &mut Trie, budget: usize, most: usize) -> usize {
        let allocator = self.pool.allocator();
        let unheld = |e: &Entry| {
            e.pages
                .iter()
                .all(|&p| allocator.references(p).is_ok_and(|n| n <= 1))
        };
        let mut cached: usize = trie
            .entries
            .values()
            .filter(|e| unheld(e))
            .map(|e| e.pages.len())
            .sum();
        let mut freed = 0;
        while cached > budget && freed < most {
            let victim = trie
                .entries
                .iter()
                .filter(|(_, e)| e.children == 0 && unheld(e))
                .min_by_key(|(_, e)| e.used)
                .map(|(&id, _)| id);
            let Some(entry) = victim.and_then(|id| trie.entries.remove(&id)) else {
                break;
            };
            trie.children.remove(&(entry.parent, entry.tokens));
            if let Some(up) = trie.entries.get_mut(&entry.parent) {
                up.children -= 1;
            }
            if let Err(err) = allocator.free_many(&entry.pages) {
                tracing::error!("freeing prefix-cache pages: {err}");
            }
            cached -= entry.pages.len();
            freed += entry.pages.len();
        }
        freed
    }
}

impl Drop for PrefixIndex {
    fn drop(&mut self) {
        let trie = self.trie.get_mut().unwrap_or_else(|p| p.into_inner());
        let allocator = self.pool.allocator();
        for entry in trie.entries.values() {
            let _ = allocator.free_many(&entry.pages);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvLayout, KvPoolConfig, SessionKv};

    const LAYERS: usize = 2;
    const PAGE: usize = 4;

    fn pool(n_pages: usize) -> Arc<KvPool> {
        let layout = KvLayout {
            n_layers: LAYERS,
            kv_dim: 4,
            page_positions: PAGE,
        };
        Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, n_pages)).unwrap())
    }

    /// A session holding `tokens.len()` committed positions, and its pages
    /// listed in `index` page by page.
    fn listed(pool: &Arc<KvPool>, index: &PrefixIndex, tokens: &[u32]) -> SessionKv {
        let mut kv = SessionKv::new(Arc::clone(pool));
        kv.reserve(tokens.len()).unwrap();
        kv.commit(tokens.len()).unwrap();
        let mut parent = PrefixIndex::ROOT;
        for (i, chunk) in tokens.chunks_exact(PAGE).enumerate() {
            let pages = kv.page_ids(i).unwrap();
            parent = index.insert(parent, chunk, &pages).unwrap().unwrap();
        }
        kv
    }

    fn references(pool: &KvPool, pages: &[u32]) -> Vec<u32> {
        pages
            .iter()
            .map(|&p| pool.allocator().references(p).unwrap())
            .collect()
    }

    #[test]
    fn a_lookup_matches_whole_pages_of_exactly_the_same_tokens() {
        let pool = pool(32);
        let index = PrefixIndex::new(Arc::clone(&pool), 0);
        let history: Vec<u32> = (0..10).collect();
        let owner = listed(&pool, &index, &history);
        assert_eq!(index.stats().entries, 2, "two full pages of 4");

        // Same first page, different second page: one page matches.
        let mut other = history.clone();
        other[5] = 99;
        let found = index.lookup(PrefixIndex::ROOT, &other, 9).unwrap();
        assert_eq!(found.pages.len(), 1);
        assert_eq!(found.pages[0], owner.page_ids(0).unwrap());
        // The lookup took a reference for its caller on each layer's page.
        assert_eq!(references(&pool, &found.pages[0]), vec![3, 3]);
        pool.allocator().free_many(&found.pages[0]).unwrap();

        // Everything matches, but never more than `most` pages.
        let found = index.lookup(PrefixIndex::ROOT, &history, 9).unwrap();
        assert_eq!(found.pages.len(), 2);
        for pages in &found.pages {
            pool.allocator().free_many(pages).unwrap();
        }
        let found = index.lookup(PrefixIndex::ROOT, &history, 1).unwrap();
        assert_eq!(found.pages.len(), 1);
        pool.allocator().free_many(&found.pages[0]).unwrap();

        // A different first token matches nothing, whatever follows.
        let mut shifted = history.clone();
        shifted[0] = 7;
        let found = index.lookup(PrefixIndex::ROOT, &shifted, 9).unwrap();
        assert!(found.pages.is_empty());
        assert_eq!(found.entry, PrefixIndex::ROOT);
    }

    #[test]
    fn listing_the_same_tokens_twice_keeps_the_first_pages() {
        let pool = pool(32);
        let index = PrefixIndex::new(Arc::clone(&pool), 0);
        let tokens: Vec<u32> = (0..8).collect();
        let first = listed(&pool, &index, &tokens);
        let second = listed(&pool, &index, &tokens);
        assert_eq!(index.stats().entries, 2);
        let found = index.lookup(PrefixIndex::ROOT, &tokens, 2).unwrap();
        assert_eq!(found.pages[1], first.page_ids(1).unwrap());
        assert_ne!(found.pages[1], second.page_ids(1).unwrap());
        for pages in &found.pages {
            pool.allocator().free_many(pages).unwrap();
        }
    }

    #[test]
    fn pages_no_session_holds_are_kept_up_to_the_budget_then_freed() {
        let pool = pool(32);
        let total = pool.total_pages();
        // No budget: closing the only holder frees everything at the trim.
        let index = PrefixIndex::new(Arc::clone(&pool), 0);
        let mut kv = listed(&pool, &index, &(0..8).collect::<Vec<_>>());
        kv.release().unwrap();
        assert_eq!(index.stats().cached_pages, 2 * LAYERS);
        index.trim();
        assert_eq!(index.stats(), PrefixStats::default());
        assert_eq!(pool.free_pages(), total);

        // A budget of one page of positions: the least recently used
        // leaf goes first, the root-side page stays.
        let index = PrefixIndex::new(Arc::clone(&pool), LAYERS);
        let mut kv = listed(&pool, &index, &(0..8).collect::<Vec<_>>());
        kv.release().unwrap();
        index.trim();
        assert_eq!(index.stats().entries, 1);
        let found = index
            .lookup(PrefixIndex::ROOT, &[0, 1, 2, 3, 9], 1)
            .unwrap();
        assert_eq!(found.pages.len(), 1, "the first page is still listed");
        // While a session holds them, pages are not the cache's to drop.
        assert_eq!(index.reclaim(usize::MAX), 0);
        for pages in &found.pages {
            pool.allocator().free_many(pages).unwrap();
        }
        // A short pool takes them back whatever the budget.
        assert_eq!(index.reclaim(usize::MAX), LAYERS);
        assert_eq!(pool.free_pages(), total);
    }

    #[test]
    fn a_chain_whose_parent_was_dropped_takes_no_new_page() {
        let pool = pool(32);
        let index = PrefixIndex::new(Arc::clone(&pool), 0);
        let mut kv = listed(&pool, &index, &[1, 2, 3, 4]);
        let parent = index.lookup(PrefixIndex::ROOT, &[1, 2, 3, 4], 1).unwrap();
        pool.allocator().free_many(&parent.pages[0]).unwrap();
        kv.release().unwrap();
        index.trim();
        let mut next = SessionKv::new(Arc::clone(&pool));
        next.reserve(4).unwrap();
        let pages = next.page_ids(0).unwrap();
        assert_eq!(
            index.insert(parent.entry, &[5, 6, 7, 8], &pages).unwrap(),
            None
        );
        assert_eq!(references(&pool, &pages), vec![1, 1]);
        assert!(index
            .lookup(parent.entry, &[5, 6, 7, 8], 1)
            .unwrap()
            .pages
            .is_empty());
    }

    #[test]
    fn dropping_the_index_gives_back_its_references() {
        let pool = pool(32);
        let total = pool.total_pages();
        let index = PrefixIndex::new(Arc::clone(&pool), usize::MAX);
        let mut kv = listed(&pool, &index, &(0..12).collect::<Vec<_>>());
        kv.release().unwrap();
        index.trim();
        assert_eq!(index.stats().cached_pages, 3 * LAYERS);
        drop(index);
        assert_eq!(pool.free_pages(), total);
    }

    #[test]
    fn a_session_maps_listed_pages_and_reads_the_same_rows() {
        let pool = pool(32);
        let index = PrefixIndex::new(Arc::clone(&pool), 0);
        let tokens: Vec<u32> = (0..8).collect();
        let mut owner = SessionKv::new(Arc::clone(&pool));
        owner.reserve(8).unwrap();
        for pos in 0..8 {
            for layer in 0..LAYERS {
                let row = [pos as f32, layer as f32, 1.5, -2.0];
                owner.write(layer, pos, &row, &row).unwrap();
            }
        }
        owner.commit(8).unwrap();
        for i in 0..2 {
            let parent = if i == 0 {
                PrefixIndex::ROOT
            } else {
                index
                    .lookup(PrefixIndex::ROOT, &tokens, 1)
                    .map(|f| {
                        pool.allocator().free_many(&f.pages[0]).unwrap();
                        f.entry
                    })
                    .unwrap()
            };
            let chunk = &tokens[i * PAGE..][..PAGE];
            index
                .insert(parent, chunk, &owner.page_ids(i).unwrap())
                .unwrap();
        }
        let found = index.lookup(PrefixIndex::ROOT, &tokens, 2).unwrap();
        let mut mapped = SessionKv::new(Arc::clone(&pool));
        mapped.adopt(&found.pages).unwrap();
        assert_eq!(mapped.len(), 8);
        for pos in 0..8 {
            for layer in 0..LAYERS {
                assert_eq!(mapped.k(layer, pos).unwrap(), owner.k(layer, pos).unwrap());
                assert_eq!(mapped.v(layer, pos).unwrap(), owner.v(layer, pos).unwrap());
            }
        }
        // Growing past them writes into pages of its own.
        mapped.reserve(9).unwrap();
        mapped.write(0, 8, &[1.0; 4], &[1.0; 4]).unwrap();
        // Not at a page end, or with pages reserved past the length: no.
        let err = mapped.adopt(&[]).unwrap_err();
        assert!(matches!(err, KvError::AdoptNotAtPageEnd { .. }), "{err}");
        let mut wrong = SessionKv::new(Arc::clone(&pool));
        let err = wrong.adopt(&[Box::from([found.pages[0][0]])]).unwrap_err();
        assert!(matches!(err, KvError::AdoptLayerMismatch { .. }), "{err}");
    }
}
