//! Prompt-lookup speculation: proposing the tokens that may come next from
//! the session's own history, for a decode that verifies several tokens in
//! one forward pass.
//!
//! The proposal is what followed the most recent earlier occurrence of the
//! history's last `n` tokens, for the longest `n` (from [`MIN_NGRAM`] up to
//! [`MAX_NGRAM`]) that occurred before: agent sessions repeat themselves (code being edited, a
//! document quoted, tool output echoed), and there the continuation is
//! often a copy. [`Lookup`] sizes the proposal by how the last one fared:
//! 1, 3, 7, then 15 tokens while proposals are accepted whole (with the
//! sampled token, passes of 2, 4, 8 and 16: whole tiles of the matrix
//! kernels from 8 on, where a proposed token costs least), back to 1 after
//! any refusal; after a proposal refused outright it rests a while. A
//! proposal costs
//! nothing when there is none; verifying changes no token (the caller
//! samples every position as plain decoding would).

/// The longest run of last tokens looked up.
pub const MAX_NGRAM: usize = 4;

/// The shortest: one or two repeated tokens are too weak a hint (in free
/// text they recur by chance, and every refused proposal costs).
pub const MIN_NGRAM: usize = 3;

/// The steps a lookup rests after a first proposal refused outright (a
/// refused token costs about a decode step), and the most it rests after
/// several in a row.
pub const FIRST_REST: usize = 4;
pub const MAX_REST: usize = 64;

/// The most tokens proposed at once (a pass of 16 with the sampled one).
pub const MAX_PROPOSAL: usize = 15;

/// How far back a lookup searches (tokens), so that a step's cost stays
/// bounded in a long session.
pub const SEARCH_WINDOW: usize = 16_384;

/// A session's proposer, with the proposal length it has learned.
#[derive(Clone, Debug)]
pub struct Lookup {
    length: usize,
    /// Steps to go without a lookup.
    resting: usize,
    /// How long the last rest was (it doubles while proposals keep being
    /// refused outright).
    rest: usize,
    proposed: u64,
    accepted: u64,
}

impl Default for Lookup {
    fn default() -> Self {
        Lookup {
            length: 1,
            resting: 0,
            rest: 0,
            proposed: 0,
            accepted: 0,
        }
    }
}

impl Lookup {
    /// The tokens that may follow `history`, at most `limit` (and at most
    /// the learned length); empty when the history's tail occurred nowhere
    /// before. After a proposal refused outright it rests (proposes nothing) for a
    /// number of steps that doubles with each such refusal, up to
    /// [`MAX_REST`]: a session with nothing to copy soon costs nothing.
    pub fn propose<'h>(&mut self, history: &'h [u32], limit: usize) -> &'h [u32] {
        if self.resting > 0 {
            self.resting -= 1;
            return &[];
        }
        let want = self.length.min(limit);
        if want == 0 {
            return &[];
        }
        let start = history.len().saturating_sub(SEARCH_WINDOW);
        for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
            if history.len() <= n {
                continue;
            }
            let tail = &history[history.len() - n..];
            // Most recent first; the match must end before the tail does.
            let found = (start..history.len() - n)
                .rev()
                .find(|&at| &history[at..at + n] == tail);
            if let Some(at) = found {
                let from = at + n;
                let end = (from + want).min(history.len());
                return &history[from..end];
            }
        }
        &[]
    }

    /// Learns from a proposal of `proposed` tokens of which the first
    /// `accepted` were the ones sampled.
    pub fn learn(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.proposed += proposed as u64;
        self.accepted += accepted as u64;
        self.length = if accepted == proposed {
            (self.length * 2 + 1).min(MAX_PROPOSAL)
        } else {
            1
        };
        if accepted == 0 {
            self.rest = (self.rest * 2).clamp(FIRST_REST, MAX_REST);
            self.resting = self.rest;
        } else {
            self.rest = 0;
        }
    }

    /// Tokens proposed and accepted so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.proposed, self.accepted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_most_recent_match_proposes_what_followed_it() {
        let mut lookup = Lookup::default();
        // The tail "4 2 3" occurred twice before: the later one was
        // followed by "7 8 4 2".
        let history = [1, 4, 2, 3, 9, 5, 4, 2, 3, 7, 8, 4, 2, 3];
        assert_eq!(lookup.propose(&history, 8), &[7]);
        lookup.learn(1, 1);
        assert_eq!(lookup.propose(&history, 8), &[7, 8, 4]);
        // A longer tail wins over a more recent shorter one.
        let history = [5, 6, 7, 8, 1, 0, 9, 6, 7, 8, 2, 5, 6, 7, 8];
        assert_eq!(lookup.propose(&history, 2), &[1, 0]);
        assert!(lookup.propose(&[1, 2, 3, 4], 8).is_empty());
        assert!(lookup.propose(&history, 0).is_empty());
    }

    #[test]
    fn the_length_follows_acceptance() {
        let mut lookup = Lookup::default();
        let history: Vec<u32> = (0..40).map(|i| i % 20).collect();
        for (len, then) in [(1, 1), (3, 3), (7, 7)] {
            assert_eq!(lookup.propose(&history, 100).len(), len);
            lookup.learn(len, then);
        }
        assert_eq!(lookup.propose(&history, 100).len(), MAX_PROPOSAL);
        lookup.learn(15, 2);
        assert_eq!(lookup.propose(&history, 100).len(), 1);
        assert_eq!(lookup.counts(), (26, 13));
    }

    #[test]
    fn refused_proposals_make_it_rest_longer_each_time() {
        let mut lookup = Lookup::default();
        let history: Vec<u32> = (0..40).map(|i| i % 20).collect();
        // Rests of 4, 8, 16 steps after three refusals in a row.
        for rest in [FIRST_REST, 8, 16] {
            assert!(!lookup.propose(&history, 100).is_empty());
            lookup.learn(1, 0);
            for _ in 0..rest {
                assert!(lookup.propose(&history, 100).is_empty());
            }
        }
        // An accepted token ends the resting.
        assert!(!lookup.propose(&history, 100).is_empty());
        lookup.learn(1, 1);
        assert!(!lookup.propose(&history, 100).is_empty());
        lookup.learn(2, 0);
        for _ in 0..FIRST_REST {
            assert!(lookup.propose(&history, 100).is_empty());
        }
        assert!(!lookup.propose(&history, 100).is_empty());
    }
}
