//! A session's place in the shared-prefix index (CONTRACT §2.12): an append
//! that starts on a page boundary maps the pages the [`PrefixIndex`] lists
//! for its tokens instead of computing them, and every page the session
//! fills is listed for the sessions after it. A mapped page holds the bits
//! the session would have computed (the KV of a history is a pure function
//! of its tokens), so nothing downstream can tell a mapped page from a
//! computed one.

use std::sync::atomic::Ordering;

use super::Session;
use crate::kv::{EntryId, KvError, PrefixIndex};
use crate::runtime::stats::Counters;
use crate::runtime::SessionId;

/// The first `pages` full pages of a session's history are listed in the
/// shared-prefix index, the last of them as `entry`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PrefixCursor {
    entry: EntryId,
    pages: usize,
}

impl PrefixCursor {
    /// Nothing listed yet: listing walks the index from its root.
    pub(super) const START: PrefixCursor = PrefixCursor {
        entry: PrefixIndex::ROOT,
        pages: 0,
    };
}

impl Session {
    /// Maps the listed pages of `tokens` after the history, when the
    /// history ends on a page boundary whose pages are all listed. At least
    /// one token is left to compute (its logits are the append's result).
    /// Returns how many tokens were mapped.
    pub(crate) fn map_prefix(
        &mut self,
        id: SessionId,
        index: &PrefixIndex,
        tokens: &[u32],
        counters: &Counters,
    ) -> usize {
        let Some(cursor) = self.prefix else {
            return 0;
        };
        let page = index.page_positions();
        let len = self.history.len();
        if cursor.pages * page != len || self.kv.capacity() != len {
            return 0;
        }
        let most = tokens.len().saturating_sub(1) / page;
        if most == 0 {
            return 0;
        }
        let found = match index.lookup(cursor.entry, tokens, most) {
            Ok(found) => found,
            Err(e) => {
                tracing::error!(session = %id, "shared-prefix lookup: {e}");
                return 0;
            }
        };
        if found.pages.is_empty() {
            return 0;
        }
        if let Err(e) = self.kv.adopt(&found.pages) {
            tracing::error!(session = %id, "mapping shared pages: {e}");
            let allocator = self.kv.pool().allocator();
            for pages in &found.pages {
                let _ = allocator.free_many(pages);
            }
            return 0;
        }
        let mapped = found.pages.len() * page;
        self.history.extend_from_slice(&tokens[..mapped]);
        self.high_water = self.kv.len();
        self.prefix = Some(PrefixCursor {
            entry: found.entry,
            pages: cursor.pages + found.pages.len(),
        });
        counters
            .prefix_reused_tokens
            .fetch_add(mapped as u64, Ordering::Relaxed);
        mapped
    }

    /// Gives back what [`Session::map_prefix`] mapped after `len` tokens,
    /// when the append it was for could not start. An error leaves the
    /// session unusable: the caller removes it.
    pub(crate) fn unmap_prefix(&mut self, len: usize) -> Result<(), KvError> {
        if self.history.len() <= len {
            return Ok(());
        }
        self.history.truncate(len);
        self.prefix = Some(PrefixCursor::START);
        self.high_water = len;
        self.kv.roll_back_to(len)
    }

    /// Lists the session's newly filled pages in the index. Runs after a
    /// committed step, before window pages are given back.
    pub(crate) fn list_full_pages(&mut self, id: SessionId, index: &PrefixIndex) {
        let Some(mut cursor) = self.prefix else {
            return;
        };
        let page = index.page_positions();
        let full = self.kv.len() / page;
        while cursor.pages < full {
            let at = cursor.pages;
            // A window layer already gave back a page: nothing after it
            // can be listed for this history.
            let Some(pages) = self.kv.page_ids(at) else {
                self.prefix = None;
                return;
            };
            let tokens = &self.history[at * page..(at + 1) * page];
            match index.insert(cursor.entry, tokens, &pages) {
                Ok(Some(entry)) => {
                    cursor = PrefixCursor {
                        entry,
                        pages: at + 1,
                    }
                }
                // The chain was dropped meanwhile: walk it again from the
                // start (the root always takes an entry).
                Ok(None) => cursor = PrefixCursor::START,
                Err(e) => {
                    tracing::error!(session = %id, "listing a shared page: {e}");
                    self.prefix = None;
                    return;
                }
            }
        }
        self.prefix = Some(cursor);
    }
}
