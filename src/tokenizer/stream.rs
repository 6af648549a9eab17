//! Incremental detokenization for streaming output: token bytes go in,
//! complete UTF-8 text comes out, and a character split across tokens is
//! held back until its last byte arrives.

use super::{Tokenizer, TokenizerError};

/// Turns a stream of token ids into text without ever emitting half a
/// character. Bytes that can never become valid UTF-8 are replaced by
/// U+FFFD, as [`String::from_utf8_lossy`] does. Like
/// [`Tokenizer::decode`], it drops one leading space of the first token for
/// SentencePiece vocabularies that add a space prefix.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    started: bool,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        let mut bytes = tokenizer
            .token_bytes(id)
            .ok_or(TokenizerError::TokenOutOfRange {
                id,
                vocab_size: tokenizer.vocab_size(),
            })?;
        if !self.started && tokenizer.strips_leading_space() {
            bytes = bytes.strip_prefix(b" ").unwrap_or(bytes);
        }
        Ok(self.push_bytes(bytes))
    }

    /// Adds raw bytes and returns the text they complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.started = true;
        self.pending.extend_from_slice(bytes);
        let mut text = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    text.push_str(valid);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // The prefix is valid UTF-8, so this copies it unchanged.
                    text.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(bad) => {
                            text.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                        // An incomplete character at the end: wait for more.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let drop_to = self.pending.len() - keep;
        self.pending.drain(..drop_to);
        text
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: whatever is still held back comes out, an
    /// incomplete character as U+FFFD.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_split_character() {
        let mut d = StreamDecoder::new();
        let euro = "€".as_bytes();
        assert_eq!(d.push_bytes(b"a"), "a");
        assert_eq!(d.push_bytes(&euro[..1]), "");
        assert_eq!(d.push_bytes(&euro[1..2]), "");
        assert_eq!(d.pending_bytes().len(), 2);
        assert_eq!(d.push_bytes(&[euro[2], b'b']), "€b");
        assert!(d.pending_bytes().is_empty());
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push_bytes(b"x\xffy"), "x\u{fffd}y");
        // A lone continuation byte is invalid at once, not pending.
        assert_eq!(d.push_bytes(b"\x80"), "\u{fffd}");
    }

    #[test]
    fn finish_flushes_incomplete() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push_bytes(&"日".as_bytes()[..2]), "");
        assert_eq!(d.finish(), "\u{fffd}");
        assert!(d.pending_bytes().is_empty());
    }
}
