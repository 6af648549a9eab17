//! One session's KV cache: a page table per layer over the shared
//! [`KvPool`], the committed length, and checked access to the K and V rows.
//!
//! A page holds one layer's K and V for `page_positions` consecutive
//! positions. Positions map to pages by `pos / page_positions` (an index into
//! the layer's table) and `pos % page_positions` (the slot inside the page).
//! Storage grows only through [`SessionKv::reserve`], which takes every page
//! it needs for every layer or none; the committed length only grows
//! ([`SessionKv::commit`], INV-2).
//!
//! A sliding-window layer (the pool says which, [`KvPool::layer_windows`])
//! sees only the last `window` positions. Once the caller declares that the
//! session will not be rolled back below its committed length
//! ([`SessionKv::settle`]), the pages of such a layer that no later position
//! can see are given back, so a long session holds
//! `global layers x length + window layers x (window + one call)` positions.
//!
//! A fork ([`SessionKv::fork`]) holds its source's full pages by reference
//! (the allocator counts the holders) and a copy of the partial last page.
//! A page more than one session holds is never written: positions are
//! written only from the committed length on, in pages
//! [`SessionKv::reserve`] made sure are this session's alone (copying a
//! shared partial page first, as after rolling back into a full page), and
//! the row writers refuse a shared page.
//!
//! Soundness of the raw access: a page is handed out to one owner, and
//! further holders only read it (above); a `SessionKv` gives its references
//! back only through `&mut self` ([`SessionKv::release`],
//! [`SessionKv::settle`], rolling back or drop), and the allocator reuses a
//! page only after its last holder let go. Shared slices are built from
//! `&self` and mutable ones from `&mut self`, so the borrow checker keeps
//! them apart exactly as it would for a `Vec`. `&SessionKv` is therefore
//! safe to share between threads reading K/V at once.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::error::KvError;
use super::pool::KvPool;

/// Which half of a layer's cache a row belongs to. The discriminant is the
/// row's index in the `[K, V]` axis of the page layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    K = 0,
    V = 1,
}

/// One layer's pages.
#[derive(Debug, Default)]
struct LayerPages {
    /// Leading pages given back (sliding-window layers only): `pages[0]`
    /// holds positions from `dropped * page_positions` on.
    dropped: usize,
    /// Pages held, in position order.
    pages: VecDeque<u32>,
}

/// A page and the checksum of its bytes.
pub type PageSum = (u32, u64);

/// A session's page tables and committed length.
pub struct SessionKv {
    pool: Arc<KvPool>,
    /// One table per layer. Every table ends at the same page, `end_page`.
    layers: Vec<LayerPages>,
    /// Pages reserved per layer, counting the dropped ones: positions below
    /// `end_page * page_positions` are backed (or were, before a window
    /// moved past them).
    end_page: usize,
    /// Committed positions.
    len: usize,
    /// The length the caller promised never to roll back below; window
    /// pages no position at or after it can see are given back.
    settled: usize,
    // Copies of the layout kept here so the hot path does not chase the Arc.
    n_layers: usize,
    kv_dim: usize,
    page_positions: usize,
    page_shift: u32,
}

impl SessionKv {
    /// An empty session: no pages, nothing committed.
    pub fn new(pool: Arc<KvPool>) -> Self {
        let layout = *pool.layout();
        SessionKv {
            pool,
            layers: (0..layout.n_layers)
                .map(|_| LayerPages::default())
                .collect(),
            end_page: 0,
            len: 0,
            settled: 0,
            n_layers: layout.n_layers,
            kv_dim: layout.kv_dim,
            page_positions: layout.page_positions,
            page_shift: layout.page_positions.trailing_zeros(),
        }
    }

    /// The pool this session's pages come from.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is committed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions reserved: writable up to here (on a window layer, only the
    /// positions its window still keeps).
    pub fn capacity(&self) -> usize {
        self.end_page << self.page_shift
    }

    /// Pages held over every layer.
    pub fn pages_held(&self) -> usize {
        self.layers.iter().map(|l| l.pages.len()).sum()
    }

    /// The pages `layer` holds, in position order, and the page index of the
    /// first (non-zero once a window moved past the start).
    pub fn page_table(&self, layer: usize) -> Option<(usize, Vec<u32>)> {
        let l = self.layers.get(layer)?;
        Some((l.dropped, l.pages.iter().copied().collect()))
    }

    /// First position `layer` still holds.
    fn first_kept(&self, layer: usize) -> usize {
        self.layers[layer].dropped << self.page_shift
    }

    /// Exactly the bytes of K and V kept for the committed positions (every
    /// layer's committed positions it still holds).
    pub fn live_bytes(&self) -> u64 {
        let row_pair = 2 * self.kv_dim as u64 * 2;
        (0..self.n_layers)
            .map(|l| self.len.saturating_sub(self.first_kept(l)) as u64 * row_pair)
            .sum()
    }

    /// Bytes of the pages held (what the session costs the pool).
    pub fn held_bytes(&self) -> u64 {
        self.pages_held() as u64 * self.pool.page_bytes() as u64
    }

    /// Pages a reservation of `total_positions` would take from the pool.
    pub fn pages_wanted(&self, total_positions: usize) -> usize {
        let held = self.end_page.saturating_mul(self.n_layers);
        self.pool
            .layout()
            .pages_for_positions(total_positions)
            .saturating_sub(held)
    }

    /// Make sure at least `total_positions` positions are backed by pages in
    /// every layer. All or nothing: on `Exhausted { wanted, free }` the
    /// session and the pool are unchanged.
    pub fn reserve(&mut self, total_positions: usize) -> Result<(), KvError> {
        if total_positions > self.len {
            self.own_partial_page()?;
        }
        let wanted = self.pages_wanted(total_positions);
        if wanted == 0 {
            return Ok(());
        }
        // A multiple of the layer count unless it saturated, and then far
        // more than the pool has: the allocator refuses it first.
        let new_pages = self.pool.allocator().alloc_many(wanted)?;
        let per_layer = wanted / self.n_layers;
        for (layer, pages) in self
            .layers
            .iter_mut()
            .zip(new_pages.chunks_exact(per_layer))
        {
            layer.pages.extend(pages);
        }
        self.end_page += per_layer;
        Ok(())
    }

    /// Makes the page that holds position `len` this session's alone in
    /// every layer where another session also holds it (a fork's source
    /// rolled back into a page the fork shares): a copy replaces it. All or
    /// nothing: on `Exhausted` nothing changed.
    fn own_partial_page(&mut self) -> Result<(), KvError> {
        let index = self.len >> self.page_shift;
        if self.len & (self.page_positions - 1) == 0 || index >= self.end_page {
            return Ok(());
        }
        let allocator = self.pool.allocator();
        let mut shared = Vec::new();
        for (layer, table) in self.layers.iter().enumerate() {
            let Some(&page) = index
                .checked_sub(table.dropped)
                .and_then(|i| table.pages.get(i))
            else {
                continue;
            };
            if allocator.references(page)? > 1 {
                shared.push((layer, page));
            }
        }
        if shared.is_empty() {
            return Ok(());
        }
        let copies = allocator.alloc_many(shared.len())?;
        for (&(_, page), &copy) in shared.iter().zip(&copies) {
            if let Err(err) = self.pool.copy_page(page, copy) {
                let _ = allocator.free_many(&copies);
                return Err(err);
            }
        }
        for (&(layer, _), &copy) in shared.iter().zip(&copies) {
            let table = &mut self.layers[layer];
            table.pages[index - table.dropped] = copy;
        }
        let originals: Vec<u32> = shared.iter().map(|&(_, page)| page).collect();
        allocator.free_many(&originals)
    }

    /// A new session holding this one's first `at` committed positions: it
    /// references this session's full pages (nothing copied, the pool
    /// counts the holders) and gets a copy of the page `at` falls inside.
    /// Both sessions then grow apart without touching each other's
    /// positions. All or nothing: on an error (`Exhausted` for the copied
    /// pages, `ForkBeyondLength`, `OutsideWindow` where a sliding-window
    /// layer already gave back pages the fork would need) nothing changed.
    pub fn fork(&self, at: usize) -> Result<SessionKv, KvError> {
        if at > self.len {
            return Err(KvError::ForkBeyondLength {
                requested: at,
                len: self.len,
            });
        }
        let windows = self.pool.layer_windows();
        for (layer, table) in self.layers.iter().enumerate() {
            // The fork's next query, at position `at`, sees from here on.
            let needed = match windows.get(layer).copied().flatten() {
                Some(window) => (at + 1).saturating_sub(window),
                None => 0,
            };
            let first_kept = table.dropped << self.page_shift;
            if needed < first_kept {
                return Err(KvError::OutsideWindow {
                    layer,
                    pos: needed,
                    first_kept,
                });
            }
        }
        let full = at >> self.page_shift;
        let partial = at & (self.page_positions - 1) != 0;
        let allocator = self.pool.allocator();
        let copies = if partial {
            allocator.alloc_many(self.n_layers)?
        } else {
            Vec::new()
        };
        let mut fork = SessionKv::new(Arc::clone(&self.pool));
        fork.len = at;
        fork.settled = at;
        fork.end_page = full + usize::from(partial);
        let mut result = Ok(());
        for (layer, (source, table)) in self.layers.iter().zip(&mut fork.layers).enumerate() {
            // A window layer keeps only what the fork can see; a page both
            // sessions reach from different windows is still one page.
            table.dropped = source.dropped;
            for &page in source
                .pages
                .iter()
                .take(full.saturating_sub(source.dropped))
            {
                if let Err(err) = allocator.share(page) {
                    result = result.and(Err(err));
                    continue;
                }
                table.pages.push_back(page);
            }
            if partial {
                let copy = copies[layer];
                table.pages.push_back(copy);
                if let Some(&page) = source.pages.get(full - source.dropped) {
                    if let Err(err) = self.pool.copy_page(page, copy) {
                        result = result.and(Err(err));
                    }
                }
            }
        }
        // On an error the fork is dropped, which gives back every
        // reference and copy it took.
        result.map(|()| fork)
    }

    /// The pool page of every layer holding positions of page `index`
    /// (`index * page_positions` on), or `None` when a window layer gave it
    /// back or it is not reserved.
    pub fn page_ids(&self, index: usize) -> Option<Box<[u32]>> {
        self.layers
            .iter()
            .map(|table| {
                index
                    .checked_sub(table.dropped)
                    .and_then(|i| table.pages.get(i).copied())
            })
            .collect()
    }

    /// Appends full pages another session computed (shared-prefix pages,
    /// one pool page per layer each, a reference already taken for this
    /// session) as committed positions. Only at a page boundary with
    /// nothing reserved beyond the committed length; on an error nothing
    /// changed and the references are still the caller's.
    pub fn adopt(&mut self, pages: &[Box<[u32]>]) -> Result<(), KvError> {
        let aligned = self.len & (self.page_positions - 1) == 0;
        if !aligned || self.capacity() != self.len {
            return Err(KvError::AdoptNotAtPageEnd {
                len: self.len,
                capacity: self.capacity(),
            });
        }
        if let Some(bad) = pages.iter().find(|p| p.len() != self.n_layers) {
            return Err(KvError::AdoptLayerMismatch {
                pages: bad.len(),
                layers: self.n_layers,
            });
        }
        for page in pages {
            for (table, &p) in self.layers.iter_mut().zip(page.iter()) {
                table.pages.push_back(p);
            }
        }
        self.end_page += pages.len();
        self.len = self.end_page << self.page_shift;
        Ok(())
    }

    /// The pages of a restored session's first blocks, taken back from a
    /// kept page file (one row per block from block 0, one entry per layer,
    /// a reference already taken for this session), as committed positions.
    /// `None` marks a sliding-window layer's page that no later position
    /// reads: per layer, the `None`s must all come before its pages. Only on
    /// an empty session; on an error nothing changed and the references are
    /// still the caller's.
    pub fn adopt_kept(&mut self, blocks: &[Box<[Option<u32>]>]) -> Result<(), KvError> {
        if self.end_page != 0 || self.len != 0 {
            return Err(KvError::AdoptNotAtPageEnd {
                len: self.len,
                capacity: self.capacity(),
            });
        }
        if let Some(bad) = blocks.iter().find(|b| b.len() != self.n_layers) {
            return Err(KvError::AdoptLayerMismatch {
                pages: bad.len(),
                layers: self.n_layers,
            });
        }
        let mut dropped = vec![0usize; self.n_layers];
        for (layer, first_held) in dropped.iter_mut().enumerate() {
            *first_held = blocks.iter().take_while(|b| b[layer].is_none()).count();
            let gap = blocks[*first_held..].iter().any(|b| b[layer].is_none());
            let windowed = self.pool.layer_window(layer).is_some();
            if gap || (*first_held > 0 && !windowed) {
                return Err(KvError::KeptPagesGap { layer });
            }
        }
        for (layer, (table, first_held)) in self.layers.iter_mut().zip(dropped).enumerate() {
            table.dropped = first_held;
            table
                .pages
                .extend(blocks[first_held..].iter().filter_map(|b| b[layer]));
        }
        self.end_page = blocks.len();
        self.len = self.end_page << self.page_shift;
        Ok(())
    }

    /// Per layer, the page holding block `block` (`None` where a window
    /// layer gave it back) and its checksum under the seed `seed(layer)`,
    /// or `None` when the block is not all committed.
    pub fn block_checksums(
        &self,
        block: usize,
        seed: impl Fn(usize) -> u64,
    ) -> Option<Box<[Option<PageSum>]>> {
        if (block + 1) << self.page_shift > self.len || !self.pool.holds_rows() {
            return None;
        }
        (0..self.n_layers)
            .map(|layer| match self.block_page(block, layer) {
                None => Some(None),
                Some(page) => {
                    // A committed full page is written by nobody: positions
                    // are written only from the committed length on.
                    let sum = self.pool.checksum_page(page, seed(layer))?;
                    Some(Some((page, sum)))
                }
            })
            .collect()
    }

    /// The page holding block `block` of `layer`, if this session holds it.
    pub fn block_page(&self, block: usize, layer: usize) -> Option<u32> {
        let table = self.layers.get(layer)?;
        table.pages.get(block.checked_sub(table.dropped)?).copied()
    }

    /// The K and V bytes (padding excluded) of `layer`'s page for block
    /// `block`, when the block is all committed and the layer holds it: what
    /// a spill writes out.
    pub fn page_bytes(&self, block: usize, layer: usize) -> Option<Cow<'_, [u8]>> {
        if (block + 1) << self.page_shift > self.len {
            return None;
        }
        let page = self.block_page(block, layer)?;
        let bytes = self.pool.layout().page_values() * 2;
        if let Some(store) = self.pool.device_store() {
            let mut out = vec![0u8; bytes];
            store.read(page, &mut out).ok()?;
            return Some(Cow::Owned(out));
        }
        let start = self.pool.page_ptr(page)?;
        // SAFETY: the page is this session's (held), valid for at least
        // `bytes` bytes; it is all committed, so nobody writes it (positions
        // are written only from the committed length on), and mutable
        // access to this session's pages needs `&mut self`.
        Some(Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(start.cast_const(), bytes)
        }))
    }

    /// Fills `layer`'s page for block `block`, beyond the committed length
    /// and reserved in a page this session holds alone, with `bytes` (a
    /// whole page, as [`SessionKv::page_bytes`] gives): reading a spilled
    /// session's pages back. The positions still need a commit.
    pub fn load_page(&mut self, block: usize, layer: usize, bytes: &[u8]) -> Result<(), KvError> {
        let len = self.pool.layout().page_values() * 2;
        if bytes.len() != len {
            return Err(KvError::RowLength {
                expected: len,
                got: bytes.len(),
            });
        }
        let pos = block << self.page_shift;
        if pos < self.len || block >= self.end_page {
            return Err(KvError::PositionOutOfRange {
                pos,
                capacity: self.capacity(),
            });
        }
        let page = self
            .block_page(block, layer)
            .ok_or(KvError::PositionOutOfRange {
                pos,
                capacity: self.capacity(),
            })?;
        if self.pool.allocator().references(page)? > 1 {
            return Err(KvError::WriteToSharedPage { page });
        }
        if let Some(store) = self.pool.device_store() {
            return store.write(page, bytes);
        }
        let start = self.pool.page_ptr(page).ok_or(KvError::NoStorage)?;
        // SAFETY: the page is held by this session alone (checked above) and
        // not committed, `&mut self` excludes every other slice of it, and
        // it is valid for at least `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), start, len) };
        Ok(())
    }

    /// Gives back the pages of a sliding-window layer before block `block`
    /// (at most up to the committed length): pages the caller knows no
    /// later position reads, such as those a spill did not keep.
    pub fn give_back_before(&mut self, layer: usize, block: usize) -> Result<(), KvError> {
        let windowed = self.pool.layer_window(layer).is_some();
        let committed = self.len >> self.page_shift;
        let Some(table) = self.layers.get_mut(layer) else {
            return Err(KvError::KeptPagesGap { layer });
        };
        if !windowed {
            return Err(KvError::KeptPagesGap { layer });
        }
        let surplus = block.min(committed).saturating_sub(table.dropped);
        let freed: Vec<u32> = table.pages.drain(..surplus).collect();
        table.dropped += surplus;
        self.pool.allocator().free_many(&freed)
    }

    /// Pages this session holds that another session holds too.
    pub fn shared_pages(&self) -> usize {
        let allocator = self.pool.allocator();
        self.layers
            .iter()
            .flat_map(|table| table.pages.iter())
            .filter(|&&page| allocator.references(page).is_ok_and(|n| n > 1))
            .count()
    }

    /// Set the committed length to `new_len`. A decrease breaks INV-2 and
    /// is an `InvariantViolation`; more than the reserved capacity is a
    /// `CommitBeyondCapacity`. Either way nothing changes.
    pub fn commit(&mut self, new_len: usize) -> Result<(), KvError> {
        if new_len < self.len {
            return Err(KvError::InvariantViolation {
                current: self.len,
                requested: new_len,
            });
        }
        if new_len > self.capacity() {
            return Err(KvError::CommitBeyondCapacity {
                requested: new_len,
                capacity: self.capacity(),
            });
        }
        self.len = new_len;
        Ok(())
    }

    /// Declares that the session will not be rolled back below its committed
    /// length, and gives back every page of a sliding-window layer that no
    /// position from there on can see (a query at `q` reads `q + 1 - window
    /// ..= q`). Every such page is returned even if one fails; the first
    /// failure is reported.
    pub fn settle(&mut self) -> Result<(), KvError> {
        self.settled = self.len;
        let mut first_error = Ok(());
        for (layer, window) in self.pool.layer_windows().iter().enumerate() {
            let Some(window) = *window else { continue };
            let oldest_seen = (self.len + 1).saturating_sub(window + self.pool.window_slack());
            let Some(pages) = self.layers.get_mut(layer) else {
                continue;
            };
            let keep_from = (oldest_seen >> self.page_shift).min(self.end_page);
            let surplus = keep_from.saturating_sub(pages.dropped);
            if surplus == 0 {
                continue;
            }
            let freed: Vec<u32> = pages.pages.drain(..surplus).collect();
            pages.dropped += surplus;
            let result = self.pool.allocator().free_many(&freed);
            if first_error.is_ok() {
                first_error = result;
            }
        }
        first_error
    }

    /// The K row of `layer` at `pos` (`pos < capacity`), `kv_dim` values.
    #[inline]
    pub fn k(&self, layer: usize, pos: usize) -> Result<&[f16], KvError> {
        self.row(Half::K, layer, pos)
    }

    /// The V row of `layer` at `pos` (`pos < capacity`), `kv_dim` values.
    #[inline]
    pub fn v(&self, layer: usize, pos: usize) -> Result<&[f16], KvError> {
        self.row(Half::V, layer, pos)
    }

    /// The K row of `layer` at `pos`, writable.
    #[inline]
    pub fn k_mut(&mut self, layer: usize, pos: usize) -> Result<&mut [f16], KvError> {
        self.row_mut(Half::K, layer, pos)
    }

    /// The V row of `layer` at `pos`, writable.
    #[inline]
    pub fn v_mut(&mut self, layer: usize, pos: usize) -> Result<&mut [f16], KvError> {
        self.row_mut(Half::V, layer, pos)
    }

    /// Store one position's K and V for `layer`, rounding f32 to f16
    /// (nearest, ties to even). Both rows must have `kv_dim` values.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) -> Result<(), KvError> {
        for row in [k, v] {
            if row.len() != self.kv_dim {
                return Err(KvError::RowLength {
                    expected: self.kv_dim,
                    got: row.len(),
                });
            }
        }
        self.k_mut(layer, pos)?.convert_from_f32_slice(k);
        self.v_mut(layer, pos)?.convert_from_f32_slice(v);
        Ok(())
    }

    /// The K rows of `layer` for `positions`, as contiguous blocks of whole
    /// rows in position order (one block per page touched). Checked once
    /// here, so iterating costs no per-row checks.
    pub fn k_blocks(&self, layer: usize, positions: Range<usize>) -> Result<KvBlocks<'_>, KvError> {
        self.blocks(Half::K, layer, positions)
    }

    /// The V rows of `layer` for `positions`, like [`SessionKv::k_blocks`].
    pub fn v_blocks(&self, layer: usize, positions: Range<usize>) -> Result<KvBlocks<'_>, KvError> {
        self.blocks(Half::V, layer, positions)
    }

    /// Undo positions computed by a call that failed: forget every position
    /// from `len` on and give back the pages no longer needed. The one
    /// deliberate decrease of the committed length; callers reset their
    /// INV-2 high-water mark with it. Below the settled length it is a
    /// `RollBackPastSettled` and changes nothing (window pages the shorter
    /// session would need may be gone). Every page past the kept ones is
    /// returned even if one fails; the first failure is reported.
    pub fn roll_back_to(&mut self, len: usize) -> Result<(), KvError> {
        if len >= self.len {
            return Ok(());
        }
        if len < self.settled {
            return Err(KvError::RollBackPastSettled {
                requested: len,
                settled: self.settled,
            });
        }
        self.len = len;
        let keep = len.div_ceil(self.page_positions);
        let mut surplus = Vec::new();
        for layer in &mut self.layers {
            let kept = keep.saturating_sub(layer.dropped).min(layer.pages.len());
            surplus.extend(layer.pages.drain(kept..));
        }
        self.end_page = keep.min(self.end_page);
        self.pool.allocator().free_many(&surplus)
    }

    /// Forgets every position from `len` on, below the settled length too:
    /// a shard told that only its first `len` positions are in step with
    /// its coordinator's history. Every sliding-window layer must still hold
    /// the pages its window reads from `len` on; otherwise it is a
    /// `RollBackPastSettled` and nothing changes.
    pub fn cut_back_to(&mut self, len: usize) -> Result<(), KvError> {
        if len >= self.len {
            return Ok(());
        }
        let windows = self.pool.layer_windows().iter().zip(&self.layers);
        for (window, table) in windows {
            let Some(window) = *window else { continue };
            let first_read = (len + 1).saturating_sub(window) >> self.page_shift;
            if table.dropped > first_read {
                return Err(KvError::RollBackPastSettled {
                    requested: len,
                    settled: self.settled,
                });
            }
        }
        self.settled = self.settled.min(len);
        self.roll_back_to(len)
    }

    /// Give every page back to the pool and forget everything committed. The
    /// session stays usable (empty). Every page is returned even if one
    /// fails; the first failure is reported.
    pub fn release(&mut self) -> Result<(), KvError> {
        let mut pages = Vec::with_capacity(self.pages_held());
        for layer in &mut self.layers {
            pages.extend(layer.pages.drain(..));
            layer.dropped = 0;
        }
        self.len = 0;
        self.settled = 0;
        self.end_page = 0;
        self.pool.allocator().free_many(&pages)
    }

    fn blocks(
        &self,
        half: Half,
        layer: usize,
        positions: Range<usize>,
    ) -> Result<KvBlocks<'_>, KvError> {
        self.check_layer(layer)?;
        let capacity = self.capacity();
        if positions.start > positions.end || positions.end > capacity {
            return Err(KvError::PositionOutOfRange {
                pos: positions.end.max(positions.start),
                capacity,
            });
        }
        let first_kept = self.first_kept(layer);
        if positions.start < positions.end && positions.start < first_kept {
            return Err(KvError::OutsideWindow {
                layer,
                pos: positions.start,
                first_kept,
            });
        }
        Ok(KvBlocks {
            session: self,
            half,
            layer,
            next: positions.start,
            end: positions.end,
        })
    }

    #[inline]
    fn check_layer(&self, layer: usize) -> Result<(), KvError> {
        if layer >= self.n_layers {
            return Err(KvError::LayerOutOfRange {
                layer,
                n_layers: self.n_layers,
            });
        }
        Ok(())
    }

    /// Pointer to the first value of the row `(half, layer, pos)`, after
    /// checking that `layer` exists and `pos` is backed by a held page. The
    /// rows of the same page that follow it, up to the page's last slot, are
    /// contiguous.
    #[inline]
    fn row_ptr(&self, half: Half, layer: usize, pos: usize) -> Result<*mut f16, KvError> {
        self.check_layer(layer)?;
        let table = &self.layers[layer];
        let index = pos >> self.page_shift;
        let Some(held) = index.checked_sub(table.dropped) else {
            return Err(KvError::OutsideWindow {
                layer,
                pos,
                first_kept: self.first_kept(layer),
            });
        };
        let page = *table
            .pages
            .get(held)
            .ok_or_else(|| KvError::PositionOutOfRange {
                pos,
                capacity: self.capacity(),
            })?;
        let page_start = self.pool.page_ptr(page).ok_or_else(|| {
            if self.pool.maps_rows() {
                KvError::AllocatorCorrupted {
                    detail: format!("session holds page {page}, which the pool does not have"),
                }
            } else {
                KvError::NoStorage
            }
        })?;
        let slot = pos & (self.page_positions - 1);
        let offset = (half as usize * self.page_positions + slot) * self.kv_dim;
        // SAFETY: slot < page_positions, so offset + kv_dim <= 2 *
        // page_positions * kv_dim, the f16 count of a page, which fits in the
        // page's stride; the page start is inside the map, so the result is
        // too.
        Ok(unsafe { page_start.cast::<f16>().add(offset) })
    }

    #[inline]
    fn row(&self, half: Half, layer: usize, pos: usize) -> Result<&[f16], KvError> {
        let ptr = self.row_ptr(half, layer, pos)?;
        // SAFETY: `row_ptr` checked that the row lies inside a page this
        // session holds; the page start is 64-byte aligned and the offset a
        // whole number of f16, so the pointer is aligned; mapped memory is
        // initialised (zero-filled or written) and every bit pattern is a
        // valid f16. The page is owned by this session alone, and mutable
        // slices of it exist only under `&mut self`, so no mutable alias
        // lives as long as this `&self` borrow.
        Ok(unsafe { std::slice::from_raw_parts(ptr, self.kv_dim) })
    }

    #[inline]
    fn row_mut(&mut self, half: Half, layer: usize, pos: usize) -> Result<&mut [f16], KvError> {
        let ptr = self.row_ptr(half, layer, pos)?;
        let table = &self.layers[layer];
        let page = table.pages[(pos >> self.page_shift) - table.dropped];
        if self.pool.allocator().references(page)? > 1 {
            return Err(KvError::WriteToSharedPage { page });
        }
        // SAFETY: as in `row`; in addition `&mut self` guarantees no other
        // slice of this session's pages is alive, and no other session holds
        // this page (checked just above: a page is shared only by a holder,
        // and this session holds its only reference), so the mutable slice
        // is exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, self.kv_dim) })
    }
}

impl Drop for SessionKv {
    fn drop(&mut self) {
        if let Err(err) = self.release() {
            tracing::error!("KV session drop: {err}");
        }
    }
}

impl std::fmt::Debug for SessionKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionKv")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("pages", &self.pages_held())
            .finish()
    }
}

/// Contiguous runs of K (or V) rows of one layer; see
/// [`SessionKv::k_blocks`]. Each item holds `n * kv_dim` values for `n`
/// consecutive positions, continuing where the previous item ended.
#[derive(Clone)]
pub struct KvBlocks<'a> {
    session: &'a SessionKv,
    half: Half,
    layer: usize,
    next: usize,
    end: usize,
}

impl<'a> Iterator for KvBlocks<'a> {
    type Item = &'a [f16];

    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.end {
            return None;
        }
        let session = self.session;
        let slot = self.next & (session.page_positions - 1);
        let rows = (self.end - self.next).min(session.page_positions - slot);
        // The range was checked when the iterator was made; an error here
        // cannot happen, and ending the iteration is the safe answer if it did.
        let ptr = session.row_ptr(self.half, self.layer, self.next).ok()?;
        self.next += rows;
        // SAFETY: as in `SessionKv::row`; the `rows` rows from `slot` stay
        // inside the same page and the same half, which is contiguous in the
        // page layout, and the slice borrows the session for 'a.
        Some(unsafe { std::slice::from_raw_parts(ptr, rows * session.kv_dim) })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::kv::pool::{KvLayout, KvPoolConfig};

    #[test]
    fn a_ledger_counts_pages_like_a_pool_and_holds_no_rows() {
        let ledger = Arc::new(KvPool::ledger(3, 4, 12).expect("ledger"));
        assert_eq!(ledger.mapped_bytes(), 0);
        assert!(!ledger.holds_rows());
        let mut kv = SessionKv::new(Arc::clone(&ledger));
        kv.reserve(6).expect("reserve");
        assert_eq!(
            kv.pages_held(),
            6,
            "two pages of positions over three layers"
        );
        assert_eq!(ledger.free_pages(), 6);
        kv.commit(6).expect("commit");
        assert_eq!(kv.len(), 6);
        assert!(
            matches!(kv.write(0, 5, &[], &[]), Err(KvError::NoStorage)),
            "a ledger has no rows to write"
        );
        assert!(matches!(
            kv.reserve(100),
            Err(KvError::Exhausted {
                wanted: 69,
                free: 6
            })
        ));
        kv.release().expect("release");
        assert_eq!(ledger.free_pages(), 12);
        assert!(KvPool::ledger(0, 4, 12).is_err());
        assert!(KvPool::ledger(3, 3, 12).is_err());
        assert!(KvPool::ledger(3, 4, 0).is_err());
    }

    fn pool(n_pages: usize) -> Arc<KvPool> {
        let layout = KvLayout {
            n_layers: 3,
            kv_dim: 4,
            page_positions: 4,
        };
        Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, n_pages)).unwrap())
    }

    /// A distinct, exactly representable value for every (half, layer, pos, i).
    fn value(half: usize, layer: usize, pos: usize, i: usize) -> f32 {
        (half * 1000 + layer * 100 + pos * 4 + i) as f32 * 0.5
    }

    #[test]
    fn rolling_back_keeps_the_prefix_and_returns_the_surplus_pages() {
        let pool = pool(12);
        let mut s = SessionKv::new(Arc::clone(&pool));
        s.reserve(14).unwrap();
        fill(&mut s, 0..14);
        s.commit(14).unwrap();
        assert_eq!(pool.free_pages(), 0);
        s.roll_back_to(5).unwrap();
        assert_eq!((s.len(), s.pages_held(), pool.free_pages()), (5, 6, 6));
        assert_eq!(s.k(2, 4).unwrap()[3].to_f32(), value(0, 2, 4, 3));
        // Never a way to grow: a longer length changes nothing.
        s.roll_back_to(9).unwrap();
        assert_eq!(s.len(), 5);
        s.roll_back_to(0).unwrap();
        assert_eq!((s.pages_held(), pool.free_pages()), (0, 12));
    }

    fn fill(session: &mut SessionKv, positions: Range<usize>) {
        for pos in positions {
            for layer in 0..3 {
                let k: Vec<f32> = (0..4).map(|i| value(0, layer, pos, i)).collect();
                let v: Vec<f32> = (0..4).map(|i| value(1, layer, pos, i)).collect();
                session.write(layer, pos, &k, &v).unwrap();
            }
        }
    }

    /// Whether `session` holds `value`'s rows at `positions` in every layer.
    fn holds_values(session: &SessionKv, positions: Range<usize>, offset: usize) -> bool {
        positions.into_iter().all(|pos| {
            (0..3).all(|layer| {
                let k = session.k(layer, pos).unwrap();
                let v = session.v(layer, pos).unwrap();
                (0..4).all(|i| {
                    k[i].to_f32() == value(0, layer, pos + offset, i)
                        && v[i].to_f32() == value(1, layer, pos + offset, i)
                })
            })
        })
    }

    #[test]
    fn a_fork_shares_full_pages_and_copies_the_partial_one() {
        let pool = pool(24);
        let mut source = SessionKv::new(Arc::clone(&pool));
        source.reserve(10).unwrap();
        fill(&mut source, 0..10);
        source.commit(10).unwrap();
        assert_eq!(pool.free_pages(), 15);
        let mut fork = source.fork(10).unwrap();
        // Positions 0..8 are two full pages per layer, shared; 8..10 a
        // partial page, copied: only 3 more pages taken.
        assert_eq!(pool.free_pages(), 12);
        assert_eq!((fork.len(), fork.pages_held()), (10, 9));
        assert_eq!((source.shared_pages(), fork.shared_pages()), (6, 6));
        assert!(holds_values(&fork, 0..10, 0));
        // Each grows apart: the fork writes other values from 10 on, the
        // source its own; neither sees the other's.
        fork.reserve(14).unwrap();
        for pos in 10..14 {
            for layer in 0..3 {
                let k: Vec<f32> = (0..4).map(|i| value(0, layer, pos + 100, i)).collect();
                let v: Vec<f32> = (0..4).map(|i| value(1, layer, pos + 100, i)).collect();
                fork.write(layer, pos, &k, &v).unwrap();
            }
        }
        fork.commit(14).unwrap();
        source.reserve(12).unwrap();
        fill(&mut source, 10..12);
        source.commit(12).unwrap();
        assert!(holds_values(&source, 0..12, 0));
        assert!(holds_values(&fork, 0..10, 0) && holds_values(&fork, 10..14, 100));
        drop(source);
        assert_eq!(fork.shared_pages(), 0, "the fork now holds its pages alone");
        assert!(holds_values(&fork, 0..10, 0));
        drop(fork);
        assert_eq!(pool.free_pages(), 24, "every page came back once");
    }

    #[test]
    fn a_source_rolled_back_into_a_shared_page_writes_into_a_copy() {
        let pool = pool(24);
        let mut source = SessionKv::new(Arc::clone(&pool));
        source.reserve(8).unwrap();
        fill(&mut source, 0..8);
        source.commit(8).unwrap();
        let fork = source.fork(8).unwrap();
        assert_eq!(
            pool.free_pages(),
            18,
            "a fork at a page boundary copies nothing"
        );
        source.roll_back_to(6).unwrap();
        // Position 6 lies in a page the fork holds too: writing it in place
        // would change the fork.
        assert!(matches!(
            source.write(0, 6, &[9.0; 4], &[9.0; 4]),
            Err(KvError::WriteToSharedPage { .. })
        ));
        source.reserve(8).unwrap();
        assert_eq!(
            pool.free_pages(),
            15,
            "the shared page was copied in each layer"
        );
        source.write(0, 6, &[9.0; 4], &[9.0; 4]).unwrap();
        assert!(holds_values(&fork, 0..8, 0), "the fork is untouched");
        assert!(holds_values(&source, 0..6, 0));
        drop((source, fork));
        assert_eq!(pool.free_pages(), 24);
    }

    #[test]
    fn a_fork_that_cannot_be_made_changes_nothing() {
        let pool = pool(9);
        let mut source = SessionKv::new(Arc::clone(&pool));
        source.reserve(10).unwrap();
        fill(&mut source, 0..10);
        source.commit(10).unwrap();
        assert!(matches!(
            source.fork(11),
            Err(KvError::ForkBeyondLength {
                requested: 11,
                len: 10
            })
        ));
        // The partial page's copies do not fit: nothing is shared or taken.
        assert!(matches!(source.fork(10), Err(KvError::Exhausted { .. })));
        assert_eq!((pool.free_pages(), source.shared_pages()), (0, 0));
        let fork = source.fork(8).unwrap();
        assert_eq!(fork.len(), 8);
        assert_eq!(pool.free_pages(), 0);
        drop((source, fork));
        assert_eq!(pool.free_pages(), 9);
    }

    #[test]
    fn written_rows_read_back_exactly_across_pages() {
        let pool = pool(9);
        let mut session = SessionKv::new(Arc::clone(&pool));
        session.reserve(10).unwrap();
        assert_eq!(session.pages_held(), 9);
        assert_eq!(session.capacity(), 12);
        fill(&mut session, 0..10);
        for pos in 0..10 {
            for layer in 0..3 {
                let k: Vec<f32> = session
                    .k(layer, pos)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let v: Vec<f32> = session
                    .v(layer, pos)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_f32())
                    .collect();
                let want_k: Vec<f32> = (0..4).map(|i| value(0, layer, pos, i)).collect();
                let want_v: Vec<f32> = (0..4).map(|i| value(1, layer, pos, i)).collect();
                assert_eq!(k, want_k, "K layer {layer} pos {pos}");
                assert_eq!(v, want_v, "V layer {layer} pos {pos}");
            }
        }
    }

    #[test]
    fn write_rounds_to_nearest_f16() {
        let mut session = SessionKv::new(pool(3));
        session.reserve(1).unwrap();
        session
            .write(2, 0, &[0.1, -3.3, 65_504.0, 1e-8], &[1.0, 2.0, 3.0, 4.0])
            .unwrap();
        let bits: Vec<u16> = session
            .k(2, 0)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let want: Vec<u16> = [0.1f32, -3.3, 65_504.0, 1e-8]
            .iter()
            .map(|&x| f16::from_f32(x).to_bits())
            .collect();
        assert_eq!(bits, want);
        assert_eq!(bits[0], 0x2E66);
    }

    #[test]
    fn mutable_rows_write_through() {
        let mut session = SessionKv::new(pool(3));
        session.reserve(4).unwrap();
        session.v_mut(1, 3).unwrap()[2] = f16::from_f32(7.5);
        session.k_mut(1, 3).unwrap()[2] = f16::from_f32(-1.0);
        assert_eq!(session.v(1, 3).unwrap()[2].to_f32(), 7.5);
        assert_eq!(session.k(1, 3).unwrap()[2].to_f32(), -1.0);
        assert_eq!(session.v(1, 2).unwrap()[2].to_f32(), 0.0);
        assert_eq!(session.v(0, 3).unwrap()[2].to_f32(), 0.0);
    }

    #[test]
    fn blocks_cover_the_range_in_page_runs() {
        let mut session = SessionKv::new(pool(9));
        session.reserve(11).unwrap();
        fill(&mut session, 0..11);
        let blocks: Vec<&[f16]> = session.k_blocks(1, 2..11).unwrap().collect();
        let lengths: Vec<usize> = blocks.iter().map(|b| b.len() / 4).collect();
        assert_eq!(lengths, vec![2, 4, 3]);
        let flat: Vec<f32> = blocks.concat().iter().map(|x| x.to_f32()).collect();
        let want: Vec<f32> = (2..11)
            .flat_map(|pos| (0..4).map(move |i| value(0, 1, pos, i)))
            .collect();
        assert_eq!(flat, want);
        let v_flat: Vec<f32> = session
            .v_blocks(2, 0..11)
            .unwrap()
            .flatten()
            .map(|x| x.to_f32())
            .collect();
        let v_want: Vec<f32> = (0..11)
            .flat_map(|pos| (0..4).map(move |i| value(1, 2, pos, i)))
            .collect();
        assert_eq!(v_flat, v_want);
        assert_eq!(session.k_blocks(0, 5..5).unwrap().count(), 0);
        assert!(session.k_blocks(0, 0..13).is_err());
        assert!(session.k_blocks(3, 0..1).is_err());
    }

    #[test]
    fn out_of_range_access_is_an_error() {
        let mut session = SessionKv::new(pool(3));
        assert!(matches!(
            session.k(0, 0),
            Err(KvError::PositionOutOfRange {
                pos: 0,
                capacity: 0
            })
        ));
        session.reserve(3).unwrap();
        assert!(matches!(
            session.v(0, 4),
            Err(KvError::PositionOutOfRange {
                pos: 4,
                capacity: 4
            })
        ));
        assert!(matches!(
            session.k(3, 0),
            Err(KvError::LayerOutOfRange {
                layer: 3,
                n_layers: 3
            })
        ));
        assert!(matches!(
            session.write(0, 0, &[1.0; 3], &[1.0; 4]),
            Err(KvError::RowLength {
                expected: 4,
                got: 3
            })
        ));
        assert!(session.write(0, usize::MAX, &[1.0; 4], &[1.0; 4]).is_err());
    }

    #[test]
    fn exhaustion_leaves_session_and_pool_unchanged() {
        let pool = pool(9);
        let mut first = SessionKv::new(Arc::clone(&pool));
        first.reserve(8).unwrap();
        let mut second = SessionKv::new(Arc::clone(&pool));
        second.reserve(1).unwrap();
        second.write(0, 0, &[1.0; 4], &[2.0; 4]).unwrap();
        second.commit(1).unwrap();
        let table_before = second.page_table(0);
        assert_eq!(second.pages_wanted(13), 9);
        match second.reserve(13) {
            Err(KvError::Exhausted { wanted: 9, free: 0 }) => {}
            other => panic!("expected exhaustion, got {other:?}"),
        }
        assert_eq!(second.page_table(0), table_before);
        assert_eq!(second.len(), 1);
        assert_eq!(second.capacity(), 4);
        assert_eq!(pool.free_pages(), 0);
        drop(first);
        assert_eq!(pool.free_pages(), 6);
        match second.reserve(16) {
            Err(KvError::Exhausted { wanted: 9, free: 6 }) => {}
            other => panic!("expected exhaustion, got {other:?}"),
        }
        assert_eq!(pool.free_pages(), 6);
        second.reserve(12).unwrap();
        assert_eq!(second.k(0, 0).unwrap()[0].to_f32(), 1.0);
        assert_eq!(pool.free_pages(), 0);
    }

    #[test]
    fn commit_never_decreases_and_never_passes_capacity() {
        let mut session = SessionKv::new(pool(6));
        session.reserve(5).unwrap();
        session.commit(3).unwrap();
        assert!(matches!(
            session.commit(2),
            Err(KvError::InvariantViolation {
                current: 3,
                requested: 2
            })
        ));
        assert!(matches!(
            session.commit(9),
            Err(KvError::CommitBeyondCapacity {
                requested: 9,
                capacity: 8
            })
        ));
        assert_eq!(session.len(), 3);
        session.commit(3).unwrap();
        session.commit(8).unwrap();
        assert_eq!(session.len(), 8);
    }

    #[test]
    fn live_bytes_are_exactly_committed_positions() {
        let layout = KvLayout {
            n_layers: 30,
            kv_dim: 192,
            page_positions: 16,
        };
        let pool = Arc::new(KvPool::new(KvPoolConfig::anonymous(layout, 60)).unwrap());
        let mut session = SessionKv::new(Arc::clone(&pool));
        assert_eq!(session.live_bytes(), 0);
        session.reserve(17).unwrap();
        session.commit(17).unwrap();
        assert_eq!(session.live_bytes(), 17 * 23_040);
        assert_eq!(session.held_bytes(), 2 * 368_640);
        assert_eq!(session.pages_held(), 60);
    }

    #[test]
    fn drop_and_release_return_every_page_once() {
        let pool = pool(15);
        {
            let mut session = SessionKv::new(Arc::clone(&pool));
            session.reserve(20).unwrap();
            assert_eq!(pool.free_pages(), 0);
        }
        assert_eq!(pool.free_pages(), 15);
        let mut session = SessionKv::new(Arc::clone(&pool));
        session.reserve(6).unwrap();
        session.commit(6).unwrap();
        session.release().unwrap();
        assert_eq!(
            (session.len(), session.capacity(), pool.free_pages()),
            (0, 0, 15)
        );
        session.release().unwrap();
        assert_eq!(pool.free_pages(), 15);
        session.reserve(1).unwrap();
        drop(session);
        let mut all = pool.allocator().alloc_many(15).unwrap();
        all.sort_unstable();
        assert_eq!(all, (0..15).collect::<Vec<u32>>());
    }

    #[test]
    fn file_backed_rows_land_where_the_page_layout_says() {
        use crate::kv::pool::KvBacking;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv.slab");
        let layout = KvLayout {
            n_layers: 2,
            kv_dim: 2,
            page_positions: 2,
        };
        let config = KvPoolConfig {
            layout,
            n_pages: 4,
            backing: KvBacking::File(path.clone()),
            prefault: false,
        };
        let pool = Arc::new(KvPool::new(config).unwrap());
        assert_eq!(pool.page_bytes(), 64);
        let mut session = SessionKv::new(pool);
        session.reserve(3).unwrap();
        let (first, table) = session.page_table(1).unwrap();
        assert_eq!((first, table.len()), (0, 2));
        // Layer 1, position 3: the second page of layer 1's table, slot 1.
        session.write(1, 3, &[1.0, 2.0], &[3.0, -2.0]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let value_at = |byte: usize| f16::from_le_bytes([bytes[byte], bytes[byte + 1]]).to_f32();
        // Element offset (half * page_positions + slot) * kv_dim inside the
        // page; pages are 64 bytes apart; page_positions = kv_dim = 2; 2
        // bytes a value.
        let page_start = table[1] as usize * 64;
        let byte_of = |half: usize, slot: usize| page_start + (half * 2 + slot) * 2 * 2;
        let (k_byte, v_byte) = (byte_of(0, 1), byte_of(1, 1));
        assert_eq!([value_at(k_byte), value_at(k_byte + 2)], [1.0, 2.0]);
        assert_eq!([value_at(v_byte), value_at(v_byte + 2)], [3.0, -2.0]);
        let nonzero = bytes.iter().filter(|&&b| b != 0).count();
        assert_eq!(nonzero, 4, "only the two rows written may be non-zero");
    }

    #[test]
    fn a_window_layer_gives_back_what_its_window_left_behind() {
        let layout = KvLayout {
            n_layers: 3,
            kv_dim: 4,
            page_positions: 4,
        };
        let pool = KvPool::new(KvPoolConfig::anonymous(layout, 30))
            .unwrap()
            .with_layer_windows(vec![Some(6), None, Some(6)])
            .unwrap();
        let pool = Arc::new(pool);
        let mut s = SessionKv::new(Arc::clone(&pool));
        s.reserve(20).unwrap();
        fill(&mut s, 0..20);
        s.commit(20).unwrap();
        assert_eq!(pool.free_pages(), 15);
        // Nothing is given back before the caller settles.
        assert_eq!(s.k(0, 0).unwrap()[0].to_f32(), value(0, 0, 0, 0));
        s.settle().unwrap();
        // The next query (position 20) sees 15..=20: layers 0 and 2 keep
        // pages from position 12 on, layer 1 keeps everything.
        assert_eq!(s.pages_held(), 2 + 5 + 2);
        assert_eq!(pool.free_pages(), 21);
        assert_eq!(s.page_table(0).unwrap().0, 3);
        assert!(matches!(
            s.k(0, 11),
            Err(KvError::OutsideWindow {
                layer: 0,
                pos: 11,
                first_kept: 12
            })
        ));
        assert!(matches!(
            s.k_blocks(2, 11..20),
            Err(KvError::OutsideWindow { .. })
        ));
        let kept: Vec<f32> = s
            .v_blocks(2, 15..20)
            .unwrap()
            .flatten()
            .map(|x| x.to_f32())
            .collect();
        let want: Vec<f32> = (15..20)
            .flat_map(|p| (0..4).map(move |i| value(1, 2, p, i)))
            .collect();
        assert_eq!(kept, want);
        assert_eq!(s.k(1, 0).unwrap()[1].to_f32(), value(0, 1, 0, 1));
        // Kept bytes: 8 positions on each window layer, 20 on the other.
        assert_eq!(s.live_bytes(), (8 + 20 + 8) * 2 * 4 * 2);
        // Growing takes pages for every layer again; rolling back to the
        // settled length is fine, below it is refused and changes nothing.
        s.reserve(26).unwrap();
        fill(&mut s, 20..26);
        s.commit(26).unwrap();
        s.roll_back_to(22).unwrap();
        assert!(matches!(
            s.roll_back_to(19),
            Err(KvError::RollBackPastSettled {
                requested: 19,
                settled: 20
            })
        ));
        assert_eq!(s.len(), 22);
        s.roll_back_to(20).unwrap();
        assert_eq!(s.pages_held(), 9);
        s.release().unwrap();
        assert_eq!(pool.free_pages(), 30);
        // Released, the session starts over with every layer from 0.
        s.reserve(1).unwrap();
        s.write(0, 0, &[1.0; 4], &[1.0; 4]).unwrap();
    }

    #[test]
    fn session_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<SessionKv>();
    }

    #[test]
    fn many_threads_read_one_session_while_others_fill_their_own() {
        let pool = pool(24);
        let mut shared = SessionKv::new(Arc::clone(&pool));
        shared.reserve(8).unwrap();
        fill(&mut shared, 0..8);
        let shared = &shared;
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(move || {
                    for _ in 0..200 {
                        for pos in 0..8 {
                            let row = shared.k(2, pos).unwrap();
                            assert_eq!(row[3].to_f32(), value(0, 2, pos, 3));
                        }
                    }
                });
            }
            for writer in 0..2usize {
                let pool = Arc::clone(&pool);
                scope.spawn(move || {
                    for round in 0..50usize {
                        let mut own = SessionKv::new(Arc::clone(&pool));
                        own.reserve(12).unwrap();
                        let tag = (writer * 100 + round) as f32;
                        for pos in 0..12 {
                            own.write(1, pos, &[tag; 4], &[-tag; 4]).unwrap();
                        }
                        for pos in 0..12 {
                            assert_eq!(own.k(1, pos).unwrap()[0].to_f32(), tag);
                            assert_eq!(own.v(1, pos).unwrap()[3].to_f32(), -tag);
                        }
                    }
                });
            }
        });
        assert_eq!(pool.free_pages(), 18);
        assert_eq!(shared.v(0, 7).unwrap()[1].to_f32(), value(1, 0, 7, 1));
    }
}
