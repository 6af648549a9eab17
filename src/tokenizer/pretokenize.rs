//! Pre-tokenization: cutting text into words before BPE runs on each word.
//!
//! This follows llama.cpp's behaviour exactly, since token ids must match
//! it. The patterns are the regular expressions of each model's
//! `tokenizer.json`, written out as code (they use Unicode categories and
//! the lookahead `\s+(?!\S)`, which a linear-time regex engine lacks),
//! the way llama.cpp's `unicode.cpp` runs them:
//!
//! - **GPT-2**: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`,
//!   where a whitespace run that is not matched keeps its last character
//!   for the next word, and anything left between matches is a word of its
//!   own.
//! - **Digits, then GPT-2** (`smollm`, `starcoder` and relatives): every
//!   `\p{N}` character is isolated first; the GPT-2 pattern then runs inside
//!   each piece, so a digit never joins a neighbouring space and a
//!   whitespace run that ends where a digit starts is kept whole.
//! - **Llama 3** (`llama-bpe`, `llama3`):
//!   `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`:
//!   case-insensitive contractions, one non-letter glued to the front of a
//!   letter run, numbers in groups of up to three, line breaks kept with
//!   the whitespace before them.
//! - **Qwen2** (`qwen2`): the Llama 3 pattern with single digits (`\p{N}`).
//! - **DeepSeek LLM** (`deepseek-llm`): six patterns applied in turn, each
//!   splitting the pieces the previous one left (matches and the text
//!   between them both become pieces): line breaks; an optional whitespace
//!   and a run of Latin, Greek, Cyrillic and similar letters (an explicit
//!   list); an optional whitespace and a run of ASCII or full-width
//!   punctuation; whitespace at the end of a piece; a run of CJK and other
//!   characters from U+0800 on; a run of numbers. llama.cpp runs these
//!   with `std::wregex` in the C locale after mapping non-ASCII whitespace
//!   to U+000B, so `\s` is exactly the Unicode `White_Space` set here too.

use unicode_general_category::{get_general_category, GeneralCategory};

/// Which pre-tokenizer a vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// The GPT-2 word pattern alone.
    Gpt2,
    /// Every number character isolated first, then the GPT-2 pattern
    /// (SmolLM, StarCoder and relatives).
    DigitsThenGpt2,
    /// The Llama 3 pattern (numbers in groups of up to three).
    Llama3,
    /// The Qwen2 pattern: Llama 3's with single digits.
    Qwen2,
    /// The Qwen3.5 pattern: Qwen2's with marks (`\p{M}`) counted as
    /// letters.
    Qwen35,
    /// DeepSeek LLM's six patterns in turn.
    DeepseekLlm,
    /// DeepSeek Coder's five patterns in turn.
    DeepseekCoder,
    /// Falcon's: runs of punctuation, then the GPT-2 pattern, then groups
    /// of three ASCII digits.
    Falcon,
}

/// `tokenizer.ggml.pre` names llama.cpp maps to its Llama 3 pre-tokenizer.
/// Those vocabularies also take a whole word as one token when the
/// vocabulary has it ("ignore merges"), and add BOS unless the file says
/// otherwise.
const LLAMA3_NAMES: &[&str] = &[
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
];

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` name, as llama.cpp maps
    /// them; `None` for names whose patterns are not implemented here.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        if LLAMA3_NAMES.contains(&name) {
            return Some(Self::Llama3);
        }
        match name {
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" | "mellum2" => Some(Self::DigitsThenGpt2),
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "jina-v1-en"
            | "jina-v2-code" | "roberta-bpe" | "exaone4" | "mpt" | "olmo" | "jais" | "trillion"
            | "granite-docling" => Some(Self::Gpt2),
            // The same pattern as Llama 3, without its other settings.
            "dbrx" | "smaug-bpe" => Some(Self::Llama3),
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2"
            | "hunyuan" | "solar-open" => Some(Self::Qwen2),
            "qwen35" => Some(Self::Qwen35),
            "deepseek-llm" => Some(Self::DeepseekLlm),
            "deepseek-coder" => Some(Self::DeepseekCoder),
            "falcon" => Some(Self::Falcon),
            _ => None,
        }
    }

    /// Whether llama.cpp treats the named vocabulary as Llama 3's: a word
    /// that is a token as a whole becomes that token without merging, and
    /// BOS is added by default.
    pub fn is_llama3_name(name: &str) -> bool {
        LLAMA3_NAMES.contains(&name)
    }

    /// Splits `text` into words, appending their byte ranges to `words`.
    /// The ranges are contiguous and cover the whole text.
    pub fn split(self, text: &str, words: &mut Vec<(usize, usize)>) {
        let chars = CharTable::new(text, self == Self::Qwen35);
        let n = chars.len();
        match self {
            Self::Gpt2 => split_gpt2(&chars, 0, n, words),
            Self::DigitsThenGpt2 => {
                let mut piece_start = 0;
                for i in 0..n {
                    if chars.class(i) == Some(CharClass::Number) {
                        split_gpt2(&chars, piece_start, i, words);
                        split_gpt2(&chars, i, i + 1, words);
                        piece_start = i + 1;
                    }
                }
                split_gpt2(&chars, piece_start, n, words);
            }
            Self::Llama3 => split_llama3(&chars, 0, n, 3, words),
            Self::Qwen2 | Self::Qwen35 => split_llama3(&chars, 0, n, 1, words),
            Self::DeepseekLlm => split_in_turn(&chars, DEEPSEEK_LLM, words),
            Self::DeepseekCoder => split_in_turn(&chars, DEEPSEEK_CODER, words),
            Self::Falcon => split_in_turn(&chars, FALCON, words),
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
    /// General category M, kept apart only for the patterns that treat
    /// marks as letters (Qwen3.5); the others see them as [`Self::Other`].
    Mark,
    /// Everything else: punctuation, symbols, controls, unassigned (and
    /// marks, unless kept apart).
    Other,
}

fn classify(c: char, marks_apart: bool) -> CharClass {
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
        G::NonspacingMark | G::SpacingMark | G::EnclosingMark if marks_apart => CharClass::Mark,
        _ => CharClass::Other,
    }
}

/// General category P (llama.cpp's `\p{P}`; whitespace never is).
fn is_punctuation(c: char) -> bool {
    use GeneralCategory as G;
    matches!(
        get_general_category(c),
        G::ConnectorPunctuation
            | G::DashPunctuation
            | G::OpenPunctuation
            | G::ClosePunctuation
            | G::InitialPunctuation
            | G::FinalPunctuation
            | G::OtherPunctuation
    )
}

/// The text's characters with their classes and byte offsets.
struct CharTable {
    chars: Vec<char>,
    classes: Vec<CharClass>,
    /// Byte offset of each character, plus the text length at the end.
    offsets: Vec<usize>,
}

impl CharTable {
    /// `marks_apart`: classify marks as [`CharClass::Mark`] rather than
    /// [`CharClass::Other`].
    fn new(text: &str, marks_apart: bool) -> Self {
        let mut chars = Vec::with_capacity(text.len());
        let mut classes = Vec::with_capacity(text.len());
        let mut offsets = Vec::with_capacity(text.len() + 1);
        for (at, c) in text.char_indices() {
            chars.push(c);
            classes.push(classify(c, marks_apart));
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
            let contraction_len = contraction(char_at(pos + 1), char_at(pos + 2));
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

/// Runs the Llama 3 word pattern over the characters `start..end`, with
/// numbers in groups of up to `digits` (3 for Llama 3, 1 for Qwen2).
/// Nothing outside the range is looked at. The steps follow llama.cpp's
/// `unicode_regex_split_custom_llama3`, alternative by alternative.
fn split_llama3(
    t: &CharTable,
    start: usize,
    end: usize,
    digits: usize,
    words: &mut Vec<(usize, usize)>,
) {
    let class_at = |i: usize| if i < end { t.class(i) } else { None };
    let char_at = |i: usize| {
        if i < end {
            t.chars.get(i).copied()
        } else {
            None
        }
    };
    let is = |i: usize, class: CharClass| class_at(i) == Some(class);
    // Marks are their own class only for Qwen3.5, whose pattern reads
    // `[\p{L}\p{M}]` where the others read `\p{L}`.
    let letter = |i: usize| matches!(class_at(i), Some(CharClass::Letter | CharClass::Mark));
    let is_line_break = |i: usize| matches!(char_at(i), Some('\r' | '\n'));
    let mut emit = |from: usize, to: usize| {
        if to > from {
            words.push((t.offsets[from], t.offsets[to]));
        }
    };
    let mut pos = start;
    while pos < end {
        let c = t.chars[pos];
        let class = t.classes[pos];

        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if c == '\'' {
            let lower = |i: usize| char_at(i).map(|c| c.to_ascii_lowercase());
            let contraction_len = contraction(lower(pos + 1), lower(pos + 2));
            if contraction_len > 0 {
                emit(pos, pos + contraction_len);
                pos += contraction_len;
                continue;
            }
        }

        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !is_line_break(pos) && class != CharClass::Number && (letter(pos) || letter(pos + 1)) {
            let mut to = pos + 1;
            while letter(to) {
                to += 1;
            }
            emit(pos, to);
            pos = to;
            continue;
        }

        // \p{N}{1,3} (Llama 3) or \p{N} (Qwen2)
        if class == CharClass::Number {
            let mut to = pos;
            while to - pos < digits && is(to, CharClass::Number) {
                to += 1;
            }
            emit(pos, to);
            pos = to;
            continue;
        }

        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`. A space with nothing after it in
        // the range is matched here too, as a word of its own.
        let after_space = if c == ' ' { pos + 1 } else { pos };
        if matches!(class_at(after_space), Some(CharClass::Other) | None) {
            let mut to = after_space;
            while is(to, CharClass::Other) {
                to += 1;
            }
            while is_line_break(to) {
                to += 1;
            }
            emit(pos, to);
            pos = to;
            continue;
        }

        let mut spaces = 0;
        let mut after_last_break = None;
        while is(pos + spaces, CharClass::Space) {
            if is_line_break(pos + spaces) {
                after_last_break = Some(pos + spaces + 1);
            }
            spaces += 1;
        }
        let to = if let Some(to) = after_last_break {
            // \s*[\r\n]+
            to
        } else if spaces > 1 && pos + spaces < end {
            // \s+(?!\S): the last space stays with the word after it.
            pos + spaces - 1
        } else if spaces > 0 {
            // \s+
            pos + spaces
        } else {
            pos + 1
        };
        emit(pos, to);
        pos = to;
    }
}

/// An inclusive range of characters in a DeepSeek LLM pattern.
type CharRange = (char, char);

/// `[A-Za-zµÀ-ÖØ-öø-ƺ...]`: the letters of DeepSeek LLM's second pattern,
/// copied from llama.cpp's `llama-vocab.cpp` (ranges merged where adjacent).
const DEEPSEEK_LETTERS: &[CharRange] = &[
    ('\u{0041}', '\u{005A}'),
    ('\u{0061}', '\u{007A}'),
    ('\u{00B5}', '\u{00B5}'),
    ('\u{00C0}', '\u{00D6}'),
    ('\u{00D8}', '\u{00F6}'),
    ('\u{00F8}', '\u{01BA}'),
    ('\u{01BC}', '\u{01BF}'),
    ('\u{01C4}', '\u{0293}'),
    ('\u{0295}', '\u{02AF}'),
    ('\u{0370}', '\u{0373}'),
    ('\u{0376}', '\u{0377}'),
    ('\u{037B}', '\u{037D}'),
    ('\u{037F}', '\u{037F}'),
    ('\u{0386}', '\u{0386}'),
    ('\u{0388}', '\u{038A}'),
    ('\u{038C}', '\u{038C}'),
    ('\u{038E}', '\u{03A1}'),
    ('\u{03A3}', '\u{03F5}'),
    ('\u{03F7}', '\u{0481}'),
    ('\u{048A}', '\u{052F}'),
    ('\u{0531}', '\u{0556}'),
    ('\u{10A0}', '\u{10C5}'),
    ('\u{13A0}', '\u{13F5}'),
    ('\u{13F8}', '\u{13FD}'),
    ('\u{1C90}', '\u{1CBA}'),
    ('\u{1CBD}', '\u{1CBF}'),
    ('\u{1D00}', '\u{1D2B}'),
    ('\u{1D6B}', '\u{1D77}'),
    ('\u{1D79}', '\u{1D9A}'),
    ('\u{1E00}', '\u{1F15}'),
    ('\u{1F18}', '\u{1F1D}'),
    ('\u{1F20}', '\u{1F45}'),
    ('\u{1F48}', '\u{1F4D}'),
    ('\u{1F50}', '\u{1F57}'),
    ('\u{1F59}', '\u{1F59}'),
    ('\u{1F5B}', '\u{1F5B}'),
    ('\u{1F5D}', '\u{1F5D}'),
    ('\u{1F5F}', '\u{1F7D}'),
    ('\u{1F80}', '\u{1FB4}'),
    ('\u{1FB6}', '\u{1FBC}'),
    ('\u{1FBE}', '\u{1FBE}'),
    ('\u{1FC2}', '\u{1FC4}'),
    ('\u{1FC6}', '\u{1FCC}'),
    ('\u{1FD0}', '\u{1FD3}'),
    ('\u{1FD6}', '\u{1FDB}'),
    ('\u{1FE0}', '\u{1FEC}'),
    ('\u{1FF2}', '\u{1FF4}'),
    ('\u{1FF6}', '\u{1FFC}'),
    ('\u{2102}', '\u{2102}'),
    ('\u{2107}', '\u{2107}'),
    ('\u{210A}', '\u{2113}'),
    ('\u{2115}', '\u{2115}'),
    ('\u{2119}', '\u{211D}'),
    ('\u{2124}', '\u{2124}'),
    ('\u{2126}', '\u{2126}'),
    ('\u{2128}', '\u{2128}'),
    ('\u{212A}', '\u{212D}'),
    ('\u{212F}', '\u{2134}'),
    ('\u{2139}', '\u{2139}'),
    ('\u{213C}', '\u{213F}'),
    ('\u{2145}', '\u{2149}'),
    ('\u{214E}', '\u{214E}'),
    ('\u{2183}', '\u{2184}'),
    ('\u{2C00}', '\u{2C7B}'),
    ('\u{2C7E}', '\u{2CE4}'),
    ('\u{2CEB}', '\u{2CEE}'),
    ('\u{2CF2}', '\u{2CF3}'),
    ('\u{A640}', '\u{A66D}'),
    ('\u{A680}', '\u{A69B}'),
    ('\u{A722}', '\u{A76F}'),
    ('\u{A771}', '\u{A787}'),
    ('\u{A78B}', '\u{A78E}'),
    ('\u{AB70}', '\u{ABBF}'),
    ('\u{FB00}', '\u{FB06}'),
    ('\u{FB13}', '\u{FB17}'),
    ('\u{FF21}', '\u{FF3A}'),
    ('\u{FF41}', '\u{FF5A}'),
    ('\u{10400}', '\u{1044F}'),
    ('\u{104B0}', '\u{104D3}'),
    ('\u{104D8}', '\u{104FB}'),
    ('\u{10C80}', '\u{10CB2}'),
    ('\u{10CC0}', '\u{10CF2}'),
    ('\u{118A0}', '\u{118DF}'),
    ('\u{1E900}', '\u{1E943}'),
];

/// `[!-/:-~！-／：-～‘-‟　-。]`: DeepSeek LLM's punctuation. `:-~` takes
/// in the ASCII letters too; U+3000 never matches, since it is whitespace.
const DEEPSEEK_PUNCTUATION: &[CharRange] = &[
    ('\u{0021}', '\u{002F}'),
    ('\u{003A}', '\u{007E}'),
    ('\u{2018}', '\u{201F}'),
    ('\u{3000}', '\u{3002}'),
    ('\u{FF01}', '\u{FF0F}'),
    ('\u{FF1A}', '\u{FF5E}'),
];

/// `[一-龥ࠀ-一가-퟿]`: DeepSeek LLM's CJK pattern, which as written spans
/// U+0800 to U+9FA5 (Indic, Thai, Hangul Jamo, ... as well as CJK).
const DEEPSEEK_CJK: &[CharRange] = &[('\u{0800}', '\u{9FA5}'), ('\u{AC00}', '\u{D7FF}')];

/// A set of characters a pattern matches.
#[derive(Clone, Copy)]
enum CharSet {
    /// Explicit ranges (`[...]` in the pattern).
    Ranges(&'static [CharRange]),
    /// `\p{L}`
    Letters,
    /// `\p{N}`
    Numbers,
    /// `\p{P}`
    Punctuation,
    /// `[\p{P}\$\+<=>\^~\|`]` (Falcon)
    PunctuationAndSymbols,
}

impl CharSet {
    /// Whitespace never matches: llama.cpp maps non-ASCII whitespace
    /// (U+3000 included) to U+000B before matching, and no set holds
    /// ASCII whitespace.
    fn contains(self, c: char, class: CharClass) -> bool {
        if class == CharClass::Space {
            return false;
        }
        match self {
            Self::Ranges(ranges) => ranges.iter().any(|&(lo, hi)| (lo..=hi).contains(&c)),
            Self::Letters => class == CharClass::Letter,
            Self::Numbers => class == CharClass::Number,
            Self::Punctuation => is_punctuation(c),
            Self::PunctuationAndSymbols => {
                is_punctuation(c)
                    || matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '~' | '|' | '`')
            }
        }
    }
}

/// One pattern of a pre-tokenizer that applies several in turn.
#[derive(Clone, Copy)]
enum Pattern {
    /// `[\r\n]`
    LineBreak,
    /// `\s?[...]+`
    SpaceThenRun(CharSet),
    /// `\s+$`
    TrailingSpace,
    /// `[...]+`
    Run(CharSet),
    /// `[...]`: every character of the set on its own.
    Single(CharSet),
    /// `[0-9][0-9][0-9]`
    ThreeDigits,
    /// The GPT-2 word pattern.
    Gpt2,
}

const DEEPSEEK_LLM: &[Pattern] = &[
    Pattern::LineBreak,
    Pattern::SpaceThenRun(CharSet::Ranges(DEEPSEEK_LETTERS)),
    Pattern::SpaceThenRun(CharSet::Ranges(DEEPSEEK_PUNCTUATION)),
    Pattern::TrailingSpace,
    Pattern::Run(CharSet::Ranges(DEEPSEEK_CJK)),
    Pattern::Run(CharSet::Numbers),
];

const DEEPSEEK_CODER: &[Pattern] = &[
    Pattern::LineBreak,
    Pattern::SpaceThenRun(CharSet::Letters),
    Pattern::SpaceThenRun(CharSet::Punctuation),
    Pattern::Run(CharSet::Ranges(DEEPSEEK_CJK)),
    Pattern::Single(CharSet::Numbers),
];

const FALCON: &[Pattern] = &[
    Pattern::Run(CharSet::PunctuationAndSymbols),
    Pattern::Gpt2,
    Pattern::ThreeDigits,
];

/// Applies `patterns` in turn, as llama.cpp's `unicode_regex_split` does:
/// each splits every piece the previous one left into its matches and the
/// text between them, and nothing crosses a piece boundary.
fn split_in_turn(t: &CharTable, patterns: &[Pattern], words: &mut Vec<(usize, usize)>) {
    // Pieces as character ranges.
    let mut pieces = vec![(0, t.len())];
    let mut next = Vec::new();
    let mut byte_words = Vec::new();
    for &pattern in patterns {
        next.clear();
        for &(start, end) in &pieces {
            if let Pattern::Gpt2 = pattern {
                byte_words.clear();
                split_gpt2(t, start, end, &mut byte_words);
                // Back from byte offsets to character indices.
                let mut at = start;
                for &(_, to) in &byte_words {
                    let mut i = at;
                    while t.offsets[i] < to {
                        i += 1;
                    }
                    next.push((at, i));
                    at = i;
                }
                continue;
            }
            let mut pos = start;
            while let Some((from, to)) = find(t, pattern, pos, end) {
                if from > pos {
                    next.push((pos, from));
                }
                next.push((from, to));
                pos = to;
            }
            if end > pos {
                next.push((pos, end));
            }
        }
        std::mem::swap(&mut pieces, &mut next);
    }
    words.extend(
        pieces
            .iter()
            .filter(|(a, b)| b > a)
            .map(|&(a, b)| (t.offsets[a], t.offsets[b])),
    );
}

/// The leftmost (then longest) match of `pattern` in the characters
/// `from..end`, as `std::regex_search` finds it; `end` is where `$` matches.
fn find(t: &CharTable, pattern: Pattern, from: usize, end: usize) -> Option<(usize, usize)> {
    let space = |i: usize| i < end && t.classes[i] == CharClass::Space;
    let within = |i: usize, set: CharSet| i < end && set.contains(t.chars[i], t.classes[i]);
    let run = |mut i: usize, set: CharSet| {
        while within(i, set) {
            i += 1;
        }
        i
    };
    match pattern {
        Pattern::LineBreak => (from..end)
            .find(|&i| matches!(t.chars[i], '\r' | '\n'))
            .map(|i| (i, i + 1)),
        Pattern::SpaceThenRun(set) => (from..end).find_map(|i| {
            if space(i) && within(i + 1, set) {
                Some((i, run(i + 1, set)))
            } else if within(i, set) {
                Some((i, run(i, set)))
            } else {
                None
            }
        }),
        Pattern::TrailingSpace => {
            let mut i = end;
            while i > from && space(i - 1) {
                i -= 1;
            }
            (i < end).then_some((i, end))
        }
        Pattern::Run(set) => (from..end)
            .find(|&i| within(i, set))
            .map(|i| (i, run(i, set))),
        Pattern::Single(set) => (from..end).find(|&i| within(i, set)).map(|i| (i, i + 1)),
        Pattern::ThreeDigits => {
            let digit = |i: usize| i < end && t.chars[i].is_ascii_digit();
            (from..end)
                .find(|&i| digit(i) && digit(i + 1) && digit(i + 2))
                .map(|i| (i, i + 3))
        }
        // Handled by the caller: it is not a single leftmost match.
        Pattern::Gpt2 => None,
    }
}

/// The length of an English contraction (`'s`, `'t`, `'m`, `'d`, `'re`,
/// `'ve`, `'ll`) whose apostrophe is followed by `next` and `after`, or 0.
fn contraction(next: Option<char>, after: Option<char>) -> usize {
    match (next, after) {
        (Some('s' | 't' | 'm' | 'd'), _) => 2,
        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => 3,
        _ => 0,
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
    fn llama3_words() {
        let pre = PreTokenizer::Llama3;
        assert_eq!(words(pre, "Hello world"), ["Hello", " world"]);
        // Contractions in any case; one non-letter joins a letter run.
        assert_eq!(words(pre, "WE'LL we'd"), ["WE", "'LL", " we", "'d"]);
        assert_eq!(words(pre, "$hello (x)"), ["$hello", " (", "x", ")"]);
        // Numbers in threes, never joined to a space.
        assert_eq!(words(pre, "1234567 89"), ["123", "456", "7", " ", "89"]);
        // Line breaks stay with the whitespace before them and with
        // punctuation before them.
        assert_eq!(words(pre, "a \n\n b"), ["a", " \n\n", " b"]);
        assert_eq!(words(pre, "!!\n\nx"), ["!!\n\n", "x"]);
        assert_eq!(words(pre, "x  y  "), ["x", " ", " y", "  "]);
    }

    #[test]
    fn qwen_words() {
        assert_eq!(
            words(PreTokenizer::Qwen2, "x 1234"),
            ["x", " ", "1", "2", "3", "4"]
        );
        // Qwen3.5 counts marks as letters; Qwen2 does not.
        assert_eq!(words(PreTokenizer::Qwen2, "e\u{301}x"), ["e", "\u{301}x"]);
        assert_eq!(words(PreTokenizer::Qwen35, "e\u{301}x"), ["e\u{301}x"]);
    }

    #[test]
    fn patterns_in_turn() {
        assert_eq!(
            words(PreTokenizer::DeepseekLlm, "Hello, 世界 123  "),
            ["Hello", ",", " ", "世界", " ", "123", "  "]
        );
        assert_eq!(
            words(PreTokenizer::DeepseekCoder, "x=1.5\n"),
            ["x", "=", "1", ".", "5", "\n"]
        );
        assert_eq!(
            words(PreTokenizer::Falcon, "a+b 1234"),
            ["a", "+", "b", " ", "123", "4"]
        );
    }

    #[test]
    fn gguf_names() {
        for (name, pre) in [
            ("llama-bpe", PreTokenizer::Llama3),
            ("llama3", PreTokenizer::Llama3),
            ("qwen2", PreTokenizer::Qwen2),
            ("qwen35", PreTokenizer::Qwen35),
            ("deepseek-llm", PreTokenizer::DeepseekLlm),
            ("gpt-2", PreTokenizer::Gpt2),
            ("smollm", PreTokenizer::DigitsThenGpt2),
        ] {
            assert_eq!(PreTokenizer::from_gguf_name(name), Some(pre), "{name}");
        }
        assert_eq!(PreTokenizer::from_gguf_name("gpt-4o"), None);
        assert!(PreTokenizer::is_llama3_name("llama-bpe"));
        assert!(!PreTokenizer::is_llama3_name("dbrx"));
    }

    #[test]
    fn ranges_cover_text() {
        let text = "  Mixed\t\tcontent 42 ünïcødé\n\n  end 東京\u{3000}'S  ";
        for pre in [
            PreTokenizer::Gpt2,
            PreTokenizer::DigitsThenGpt2,
            PreTokenizer::Llama3,
            PreTokenizer::Qwen2,
            PreTokenizer::Qwen35,
            PreTokenizer::DeepseekLlm,
            PreTokenizer::DeepseekCoder,
            PreTokenizer::Falcon,
        ] {
            let mut ranges = Vec::new();
            pre.split(text, &mut ranges);
            let mut at = 0;
            for &(a, b) in &ranges {
                assert_eq!(a, at, "{pre:?}");
                assert!(b > a, "{pre:?}");
                at = b;
            }
            assert_eq!(at, text.len(), "{pre:?}");
        }
    }
}
