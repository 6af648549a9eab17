//! Byte-pair merging over token ids.
//!
//! A word starts as one token per byte; the adjacent pair with the lowest
//! merge rank (leftmost on ties) is merged until no mergeable pair is left.
//! Pairs wait in a binary heap and are checked when popped, so a word of n
//! bytes costs O(n log n) rather than a rescan per merge.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Rank and result of merging two adjacent tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Merge {
    /// Position in the merge list: lower merges first.
    pub rank: u32,
    /// The token the pair becomes.
    pub merged: u32,
}

/// A multiplicative hasher for vocabulary texts and (left, right) id
/// pairs. The keys come from the model file, not from requests, so flooding
/// is not a concern, and SipHash would dominate the tokenizer's load time
/// (about 100k token and merge look-ups).
#[derive(Default)]
pub struct FastHasher(u64);

impl Hasher for FastHasher {
    fn finish(&self) -> u64 {
        // The multiply only carries entropy upwards; fold the high half
        // back down, since the table indexes buckets by the low bits.
        let x = (self.0 ^ (self.0 >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^ (x >> 33)
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
        let mut tail = [0u8; 8];
        let rest = chunks.remainder();
        tail[..rest.len()].copy_from_slice(rest);
        self.write_u64(u64::from_le_bytes(tail) ^ ((rest.len() as u64) << 59));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// Merge table keyed by `(left << 32) | right`.
pub type MergeTable = HashMap<u64, Merge, FastBuildHasher>;

/// Builds [`FastHasher`]s.
pub type FastBuildHasher = BuildHasherDefault<FastHasher>;

/// The key of the pair (left, right) in a [`MergeTable`].
pub fn pair_key(left: u32, right: u32) -> u64 {
    (u64::from(left) << 32) | u64::from(right)
}

/// One symbol of the word being merged: a token id in a linked list.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: Option<usize>,
    next: Option<usize>,
    alive: bool,
}

/// A candidate merge, ordered by rank, then by left position.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    rank: u32,
    left: usize,
    right: usize,
    left_id: u32,
    right_id: u32,
    merged: u32,
}

/// Reusable buffers for merging words.
#[derive(Default)]
pub struct BpeScratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Reverse<Candidate>>,
}

impl BpeScratch {
    /// Merges `ids` (one token per byte of a word) and appends the result.
    pub fn merge_word(&mut self, merges: &MergeTable, ids: &[u32], out: &mut Vec<u32>) {
        if ids.len() < 2 {
            out.extend_from_slice(ids);
            return;
        }
        self.symbols.clear();
        self.heap.clear();
        let last = ids.len() - 1;
        self.symbols
            .extend(ids.iter().enumerate().map(|(i, &id)| Symbol {
                id,
                prev: i.checked_sub(1),
                next: (i < last).then_some(i + 1),
                alive: true,
            }));
        for left in 0..last {
            self.push_candidate(merges, left, left + 1);
        }

        while let Some(Reverse(c)) = self.heap.pop() {
            let (l, r) = (self.symbols[c.left], self.symbols[c.right]);
            // Stale entries: one side was merged away or has grown since.
            if !l.alive || !r.alive || l.id != c.left_id || r.id != c.right_id {
                continue;
            }
            self.symbols[c.left].id = c.merged;
            self.symbols[c.left].next = r.next;
            self.symbols[c.right].alive = false;
            if let Some(after) = r.next {
                self.symbols[after].prev = Some(c.left);
                self.push_candidate(merges, c.left, after);
            }
            if let Some(before) = l.prev {
                self.push_candidate(merges, before, c.left);
            }
        }

        let mut at = Some(0);
        while let Some(i) = at {
            out.push(self.symbols[i].id);
            at = self.symbols[i].next;
        }
    }

    fn push_candidate(&mut self, merges: &MergeTable, left: usize, right: usize) {
        let (left_id, right_id) = (self.symbols[left].id, self.symbols[right].id);
        if let Some(m) = merges.get(&pair_key(left_id, right_id)) {
            self.heap.push(Reverse(Candidate {
                rank: m.rank,
                left,
                right,
                left_id,
                right_id,
                merged: m.merged,
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tokens: 0 'a', 1 'b', 2 'c', 3 "ab", 4 "bc", 5 "abc", 6 "aa".
    fn table(list: &[(u32, u32, u32)]) -> MergeTable {
        list.iter()
            .enumerate()
            .map(|(rank, &(l, r, m))| {
                let rank = u32::try_from(rank).unwrap_or(u32::MAX);
                (pair_key(l, r), Merge { rank, merged: m })
            })
            .collect()
    }

    fn run(merges: &MergeTable, ids: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        BpeScratch::default().merge_word(merges, ids, &mut out);
        out
    }

    #[test]
    fn fast_hasher_separates_lengths_and_contents() {
        use std::hash::BuildHasher;
        let h = |s: &str| FastBuildHasher::default().hash_one(s);
        assert_ne!(h("ab"), h("ab\0"));
        assert_ne!(h("abcdefgh"), h("abcdefgi"));
        assert_ne!(h("Ġthe"), h("Ġtha"));
        assert_eq!(h("same"), h("same"));
    }

    #[test]
    fn lowest_rank_wins() {
        // "bc" ranks before "ab": a b c -> a bc, and "abc" needs ab + c.
        let merges = table(&[(1, 2, 4), (0, 1, 3), (3, 2, 5)]);
        assert_eq!(run(&merges, &[0, 1, 2]), [0, 4]);
        let merges = table(&[(0, 1, 3), (1, 2, 4), (3, 2, 5)]);
        assert_eq!(run(&merges, &[0, 1, 2]), [5]);
    }

    #[test]
    fn ties_merge_leftmost_first() {
        let merges = table(&[(0, 0, 6)]);
        assert_eq!(run(&merges, &[0, 0, 0]), [6, 0]);
        assert_eq!(run(&merges, &[0, 0, 0, 0]), [6, 6]);
    }

    #[test]
    fn no_merges_keeps_bytes() {
        let merges = table(&[]);
        assert_eq!(run(&merges, &[2, 1, 0]), [2, 1, 0]);
        assert_eq!(run(&merges, &[1]), [1]);
        assert!(run(&merges, &[]).is_empty());
    }

    #[test]
    fn merged_symbol_merges_again_with_left_neighbour() {
        // b c -> bc first, then a bc -> abc via a later-ranked merge.
        let merges = table(&[(1, 2, 4), (0, 4, 5)]);
        assert_eq!(run(&merges, &[0, 1, 2]), [5]);
    }
}
