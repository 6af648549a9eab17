//! Pre-tokenization: cutting text into words before BPE runs on each word.
//!
//! This follows llama.cpp's behaviour exactly, since token ids must match
//! it. For the GPT-2 family the word pattern is
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`,
//! where a whitespace run that is not matched keeps its last character for
//! the next word, and anything left between matches is a word of its own.
//! The `smollm` family (and others with the same settings) first isolates
//! every `\p{N}` character; the GPT-2 pattern then runs inside each piece,
//! so a digit never joins a neighbouring space and a whitespace run that
//! ends where a digit starts is kept whole.

use unicode_general_category::{get_general_category, GeneralCategory};

/// Which pre-tokenizer a vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// The GPT-2 word pattern alone.
    Gpt2,
    /// Every number character isolated first, then the GPT-2 pattern
    /// (SmolLM, StarCoder and relatives).
    DigitsThenGpt2,
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` name, as llama.cpp maps
    /// them; `None` for names whose patterns are not implemented here.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" | "mellum2" => Some(Self::DigitsThenGpt2),
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en"
            | "jina-v2-code" | "roberta-bpe" | "exaone4" | "mpt" | "olmo" | "jais" | "trillion"
            | "granite-docling" => Some(Self::Gpt2),
            _ => None,
        }
    }

    /// Splits `text` into words, appending their byte ranges to `words`.
    /// The ranges are contiguous and cover the whole text.
    pub fn split(self, text: &str, words: &mut Vec<(usize, usize)>) {
        let chars = CharTable::new(text);
        match self {
            Self::Gpt2 => split_gpt2(&chars, 0, chars.len(), words),
            Self::DigitsThenGpt2 => {
                let mut piece_start = 0;
                for i in 0..chars.len() {
                    if chars.class(i) == Some(CharClass::Number) {
                        split_gpt2(&chars, piece_start, i, words);
                        split_gpt2(&chars, i, i + 1, words);
                        piece_start = i + 1;
                    }
                }
                split_gpt2(&chars, piece_start, chars.len(), words);
            }
        }
    }
}

/// The character classes the word pattern distinguishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CharClass {
    /// General category L.
    Letter,
    /// General category N.
    Number,
    /// The Unicode `White_Space` property (the same set llama.cpp uses).
    Space,
    /// Everything else: punctuation, symbols, marks, controls, unassigned.
    Other,
}

fn classify(c: char) -> CharClass {
    if c.is_ascii() {
        return if c.is_ascii_alphabetic() {
            CharClass::Letter
        } else if c.is_ascii_digit() {
            CharClass::Number
        } else if c.is_ascii_whitespace() || c == '\u{0B}' {
            CharClass::Space
        } else {
            CharClass::Other
        };
    }
    if c.is_whitespace() {
        return CharClass::Space;
    }
    use GeneralCategory as G;
    match get_general_category(c) {
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter => CharClass::Letter,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => CharClass::Number,
        _ => CharClass::Other,
    }
}

/// The text's characters with their classes and byte offsets.
struct CharTable {
    chars: Vec<char>,
    classes: Vec<CharClass>,
    /// Byte offset of each character, plus the text length at the end.
    offsets: Vec<usize>,
}

impl CharTable {
    fn new(text: &str) -> Self {
        let mut chars = Vec::with_capacity(text.len());
        let mut classes = Vec::with_capacity(text.len());
        let mut offsets = Vec::with_capacity(text.len() + 1);
        for (at, c) in text.char_indices() {
            chars.push(c);
            classes.push(classify(c));
            offsets.push(at);
        }
        offsets.push(text.len());
        Self {
            chars,
            classes,
            offsets,
        }
    }

    fn len(&self) -> usize {
        self.chars.len()
    }

    fn class(&self, i: usize) -> Option<CharClass> {
        self.classes.get(i).copied()
    }
}

/// Runs the GPT-2 word pattern over the characters `start..end`; nothing
/// outside that range is looked at (lookahead included).
fn split_gpt2(t: &CharTable, start: usize, end: usize, words: &mut Vec<(usize, usize)>) {
    let class_at = |i: usize| if i < end { t.class(i) } else { None };
    let char_at = |i: usize| {
        if i < end {
            t.chars.get(i).copied()
        } else {
            None
        }
    };
    let mut emit = |from: usize, to: usize| {
        if to > from {
            words.push((t.offsets[from], t.offsets[to]));
        }
    };
    let mut pos = start;
    while pos < end {
        let c = t.chars[pos];

        if c == '\'' {
            let contraction_len = match (char_at(pos + 1), char_at(pos + 2)) {
                (Some('s' | 't' | 'm' | 'd'), _) => 2,
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => 3,
                _ => 0,
            };
            if contraction_len > 0 {
                emit(pos, pos + contraction_len);
                pos += contraction_len;
                continue;
            }
        }

        // ` ?X+`: an optional leading space, then a run of one class. The
        // class is decided by the character after the space.
        let leading_space = usize::from(c == ' ');
        let run_class = class_at(pos + leading_space);
        if let Some(class @ (CharClass::Letter | CharClass::Number | CharClass::Other)) = run_class
        {
            let mut to = pos + leading_space;
            while class_at(to) == Some(class) {
                to += 1;
            }
            emit(pos, to);
            pos = to;
            continue;
        }

        let mut spaces = 0;
        while class_at(pos + spaces) == Some(CharClass::Space) {
            spaces += 1;
        }
        let to = if spaces > 1 && pos + spaces < end {
            // `\s+(?!\S)`: the last space stays with the word after it.
            pos + spaces - 1
        } else if spaces > 0 {
            pos + spaces
        } else {
            pos + 1
        };
        emit(pos, to);
        pos = to;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, text: &str) -> Vec<&str> {
        let mut ranges = Vec::new();
        pre.split(text, &mut ranges);
        ranges.iter().map(|&(a, b)| &text[a..b]).collect()
    }

    #[test]
    fn gpt2_basic_words() {
        assert_eq!(
            words(PreTokenizer::Gpt2, "Hello world, it's 2024!"),
            ["Hello", " world", ",", " it", "'s", " 2024", "!"]
        );
    }

    #[test]
    fn whitespace_run_leaves_last_space_for_next_word() {
        assert_eq!(words(PreTokenizer::Gpt2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(
            words(PreTokenizer::Gpt2, "a \n\nb"),
            ["a", " \n", "\n", "b"]
        );
        assert_eq!(words(PreTokenizer::Gpt2, "a   "), ["a", "   "]);
        assert_eq!(words(PreTokenizer::Gpt2, "\tx"), ["\t", "x"]);
    }

    #[test]
    fn contractions_are_lowercase_only() {
        assert_eq!(words(PreTokenizer::Gpt2, "we'll"), ["we", "'ll"]);
        assert_eq!(words(PreTokenizer::Gpt2, "WE'LL"), ["WE", "'", "LL"]);
        assert_eq!(words(PreTokenizer::Gpt2, "'"), ["'"]);
    }

    #[test]
    fn digits_are_isolated_for_smollm() {
        let pre = PreTokenizer::DigitsThenGpt2;
        assert_eq!(words(pre, "x 123"), ["x", " ", "1", "2", "3"]);
        assert_eq!(words(pre, "a  1"), ["a", "  ", "1"]);
        assert_eq!(words(pre, "3.14"), ["3", ".", "1", "4"]);
    }

    #[test]
    fn unicode_classes() {
        assert_eq!(
            words(PreTokenizer::Gpt2, "naïve café 東京 😀!"),
            ["naïve", " café", " 東京", " 😀!"]
        );
        // U+0301 COMBINING ACUTE ACCENT is a mark, not a letter.
        assert_eq!(words(PreTokenizer::Gpt2, "e\u{301}"), ["e", "\u{301}"]);
        assert_eq!(
            words(PreTokenizer::Gpt2, "a\u{3000}b"),
            ["a", "\u{3000}", "b"]
        );
    }

    #[test]
    fn ranges_cover_text() {
        let text = "  Mixed\t\tcontent 42 ünïcødé\n\n  end  ";
        let mut ranges = Vec::new();
        PreTokenizer::DigitsThenGpt2.split(text, &mut ranges);
        let mut at = 0;
        for &(a, b) in &ranges {
            assert_eq!(a, at);
            assert!(b > a);
            at = b;
        }
        assert_eq!(at, text.len());
    }
}
