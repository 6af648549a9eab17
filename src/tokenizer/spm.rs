//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`), as llama.cpp
//! runs it: the text (spaces already written as U+2581 "▁") starts as one
//! symbol per character; the adjacent pair whose concatenation is a token
//! with the highest score merges first (leftmost on ties), until no pair
//! is a token. A final symbol that is not a token falls back to byte tokens
//! (`<0xXX>`).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::token_texts::TokenTexts;
use super::TokenizerError;

/// One symbol: a byte range of the text in a linked list.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge; the heap pops the highest score, then the lowest
/// left position.
#[derive(Clone, Copy)]
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text, to spot stale entries.
    size: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// What SentencePiece merging needs from the vocabulary.
pub struct SpmVocab<'a> {
    pub texts: &'a TokenTexts,
    pub scores: &'a [f32],
    /// The token for each byte when a symbol is not a token.
    pub byte_ids: &'a [Option<u32>; 256],
}

/// Reusable buffers for SentencePiece merging.
#[derive(Default)]
pub struct SpmScratch {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Candidate>,
}

impl SpmScratch {
    /// Tokenizes `text` (spaces already escaped) and appends the ids.
    pub fn encode(
        &mut self,
        vocab: &SpmVocab<'_>,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        self.symbols.clear();
        self.heap.clear();
        let count = text.chars().count();
        for (i, (start, c)) in text.char_indices().enumerate() {
            self.symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: (i + 1 < count).then_some(i + 1),
            });
        }
        for left in 1..self.symbols.len() {
            self.push_candidate(vocab, text, left - 1, left);
        }

        while let Some(c) = self.heap.pop() {
            let (l, r) = (self.symbols[c.left], self.symbols[c.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != c.size {
                continue;
            }
            self.symbols[c.left].len += r.len;
            self.symbols[c.right].len = 0;
            self.symbols[c.left].next = r.next;
            if let Some(after) = r.next {
                self.symbols[after].prev = Some(c.left);
            }
            if let Some(before) = l.prev {
                self.push_candidate(vocab, text, before, c.left);
            }
            if let Some(after) = r.next {
                self.push_candidate(vocab, text, c.left, after);
            }
        }

        let mut at = (!self.symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let s = self.symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match vocab.texts.id_of(piece) {
                Some(id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id = vocab.byte_ids[usize::from(b)]
                            .ok_or(TokenizerError::MissingByteToken { byte: b })?;
                        out.push(id);
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }

    fn push_candidate(&mut self, vocab: &SpmVocab<'_>, text: &str, left: usize, right: usize) {
        let (l, r) = (self.symbols[left], self.symbols[right]);
        let size = l.len + r.len;
        let Some(id) = vocab.texts.id_of(&text[l.start..l.start + size]) else {
            return;
        };
        let score = vocab.scores.get(id as usize).copied().unwrap_or(0.0);
        self.heap.push(Candidate {
            score,
            left,
            right,
            size,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(texts: &[&str], scores: &[f32], text: &str) -> Result<Vec<u32>, TokenizerError> {
        let owned: Vec<String> = texts.iter().map(|s| s.to_string()).collect();
        let texts = TokenTexts::new(&owned);
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = texts.id_of(&format!("<0x{b:02X}>"));
        }
        let vocab = SpmVocab {
            texts: &texts,
            scores,
            byte_ids: &byte_ids,
        };
        let mut out = Vec::new();
        SpmScratch::default().encode(&vocab, text, &mut out)?;
        Ok(out)
    }

    #[test]
    fn highest_score_merges_first() {
        // 0 a, 1 b, 2 c, 3 ab, 4 bc, 5 abc
        let texts = ["a", "b", "c", "ab", "bc", "abc"];
        // "bc" outscores "ab": a + bc, and "abc" is reachable from there.
        assert_eq!(
            run(&texts, &[0., 0., 0., -2., -1., -3.], "abc").unwrap(),
            [5]
        );
        let texts = ["a", "b", "c", "ab", "bc"];
        assert_eq!(run(&texts, &[0., 0., 0., -2., -1.], "abc").unwrap(), [0, 4]);
        assert_eq!(run(&texts, &[0., 0., 0., -1., -2.], "abc").unwrap(), [3, 2]);
    }

    #[test]
    fn ties_go_leftmost() {
        let texts = ["a", "aa"];
        assert_eq!(run(&texts, &[0., -1.], "aaa").unwrap(), [1, 0]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes() {
        let texts = ["a", "<0xC3>", "<0xA9>"];
        assert_eq!(run(&texts, &[0., 0., 0.], "aé").unwrap(), [0, 1, 2]);
        assert!(matches!(
            run(&texts, &[0., 0., 0.], "z"),
            Err(TokenizerError::MissingByteToken { byte: b'z' })
        ));
        assert!(run(&texts, &[0., 0., 0.], "").unwrap().is_empty());
    }
}
