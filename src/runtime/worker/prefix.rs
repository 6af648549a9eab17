//! Shared prefixes on a worker (CONTRACT §2.12): an append that starts on a
//! page boundary maps the pages the [`PrefixIndex`] lists for its tokens
//! instead of computing them, and every page a session fills is listed for
//! the sessions after it. A mapped page holds the bits the session would
//! have computed (the KV of a history is a pure function of its tokens), so
//! nothing downstream can tell a mapped page from a computed one.
//!
//! Mapping is part of the append's reservation: it happens before the rest
//! is reserved and is given back with it when the append cannot start, and
//! the append's undo cuts the history back below it like any other token.

use super::*;

impl Worker {
    /// Maps the listed pages of `tokens` after session `id`'s history, when
    /// the history ends on a page boundary whose pages are all listed. At
    /// least one token is left to compute (its logits are the append's
    /// result). Returns how many tokens were mapped.
    pub(super) fn map_prefix(&mut self, id: SessionId, tokens: &[u32]) -> usize {
        let Some(index) = &self.shared.prefix else {
            return 0;
        };
        let Some(slot) = self.sessions.get_mut(&id) else {
            return 0;
        };
        let Some(cursor) = slot.prefix else {
            return 0;
        };
        let page = index.page_positions();
        let len = slot.history.len();
        if cursor.pages * page != len || slot.kv.capacity() != len {
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
        if let Err(e) = slot.kv.adopt(&found.pages) {
            tracing::error!(session = %id, "mapping shared pages: {e}");
            let allocator = self.kv_pool.allocator();
            for pages in &found.pages {
                let _ = allocator.free_many(pages);
            }
            return 0;
        }
        let mapped = found.pages.len() * page;
        slot.history.extend_from_slice(&tokens[..mapped]);
        slot.high_water = slot.kv.len();
        slot.prefix = Some(PrefixCursor {
            entry: found.entry,
            pages: cursor.pages + found.pages.len(),
        });
        self.shared
            .counters
            .prefix_reused_tokens
            .fetch_add(mapped as u64, Ordering::Relaxed);
        mapped
    }

    /// Gives back what [`Worker::map_prefix`] mapped after `len` tokens,
    /// when the append it was for could not start.
    pub(super) fn unmap_prefix(&mut self, id: SessionId, len: usize) {
        let Some(slot) = self.sessions.get_mut(&id) else {
            return;
        };
        if slot.history.len() <= len {
            return;
        }
        slot.history.truncate(len);
        slot.prefix = Some(PrefixCursor::START);
        slot.high_water = len;
        if let Err(e) = slot.kv.roll_back_to(len) {
            tracing::error!(session = %id, "giving back shared pages: {e}");
            self.fail_session(id, e.into());
        }
    }

    /// Lists the session's newly filled pages in the index. Runs after a
    /// committed step, before window pages are given back.
    pub(super) fn list_full_pages(&mut self, id: SessionId) {
        let Some(index) = &self.shared.prefix else {
            return;
        };
        let Some(slot) = self.sessions.get_mut(&id) else {
            return;
        };
        let Some(mut cursor) = slot.prefix else {
            return;
        };
        let page = index.page_positions();
        let full = slot.kv.len() / page;
        while cursor.pages < full {
            let at = cursor.pages;
            // A window layer already gave back a page: nothing after it
            // can be listed for this history.
            let Some(pages) = slot.kv.page_ids(at) else {
                slot.prefix = None;
                return;
            };
            let tokens = &slot.history[at * page..(at + 1) * page];
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
                    slot.prefix = None;
                    return;
                }
            }
        }
        slot.prefix = Some(cursor);
    }

    /// Frees pages only the prefix cache holds, toward `wanted` more free
    /// pages than `free`. Returns whether any were freed.
    pub(super) fn reclaim_cached(&self, wanted: usize, free: usize) -> bool {
        self.shared
            .prefix
            .as_ref()
            .is_some_and(|index| index.reclaim(wanted.saturating_sub(free)) > 0)
    }

    /// Pages the prefix cache could free.
    pub(super) fn cached_pages(&self) -> usize {
        self.shared
            .prefix
            .as_ref()
            .map_or(0, |index| index.stats().cached_pages)
    }

    /// Lets the prefix cache drop what is over its budget once a session
    /// let go of pages.
    pub(super) fn trim_prefix_cache(&self) {
        if let Some(index) = &self.shared.prefix {
            index.trim();
        }
    }
}
