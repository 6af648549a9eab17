//! llama.cpp's GBNF grammars, rewritten into llguidance's Lark syntax:
//! rules `name ::= ...` (the start rule is `root`), string literals,
//! character classes (`[...]`, `[^...]`), `.`, grouping, `|`, `*`, `+`,
//! `?`, `{m}`, `{m,}`, `{m,n}` and `#` comments. A rule's body runs until
//! the next `name ::=`, so line breaks inside a rule are free.

use std::collections::HashMap;

/// One piece of GBNF text.
#[derive(Clone, Debug, PartialEq)]
enum Token {
    Name(String),
    Defines,
    /// A string literal's decoded text.
    Literal(String),
    /// A character class: whether negated, its chars and ranges.
    Class(bool, Vec<(char, char)>),
    Any,
    /// `(`, `)`, `|`, `*`, `+`, `?`, or a `{...}` bound as written.
    Symbol(String),
}

/// The Lark grammar `gbnf` means, or why it is not GBNF.
pub fn to_lark(gbnf: &str) -> Result<String, String> {
    let tokens = tokenize(gbnf)?;
    let mut names: HashMap<String, String> = HashMap::new();
    let mut rules: Vec<(String, Vec<Token>)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let (Token::Name(name), Some(Token::Defines)) = (&tokens[i], tokens.get(i + 1)) else {
            return Err(format!("expected `name ::=` at {:?}", tokens[i]));
        };
        let mut end = i + 2;
        while end < tokens.len()
            && !(matches!(tokens[end], Token::Name(_))
                && tokens.get(end + 1) == Some(&Token::Defines))
        {
            end += 1;
        }
        if end == i + 2 {
            return Err(format!("rule {name} has no body"));
        }
        let lark_name = format!("r_{}", rules.len());
        if names.insert(name.clone(), lark_name).is_some() {
            return Err(format!("rule {name} is defined twice"));
        }
        rules.push((name.clone(), tokens[i + 2..end].to_vec()));
        i = end;
    }
    let root = names
        .get("root")
        .ok_or("the grammar has no `root` rule")?
        .clone();
    let mut out = format!("start: {root}\n");
    for (name, body) in &rules {
        out.push_str(&names[name]);
        out.push(':');
        for token in body {
            out.push(' ');
            match token {
                Token::Name(n) => out.push_str(
                    names
                        .get(n)
                        .ok_or_else(|| format!("rule {name} names undefined rule {n}"))?,
                ),
                Token::Literal(text) => {
                    out.push_str(&serde_json::to_string(text).map_err(|e| e.to_string())?)
                }
                Token::Class(negated, ranges) => out.push_str(&class_regex(*negated, ranges)),
                Token::Any => out.push_str("/(?s:.)/"),
                Token::Symbol(s) => out.push_str(s),
                Token::Defines => return Err("`::=` inside a rule".into()),
            }
        }
        out.push('\n');
    }
    Ok(out)
}

/// A character class as a Lark regex, every char written as `\x{...}`.
fn class_regex(negated: bool, ranges: &[(char, char)]) -> String {
    let mut rx = String::from("/[");
    if negated {
        rx.push('^');
    }
    for &(lo, hi) in ranges {
        rx.push_str(&format!("\\x{{{:x}}}", lo as u32));
        if hi != lo {
            rx.push_str(&format!("-\\x{{{:x}}}", hi as u32));
        }
    }
    rx.push_str("]/");
    rx
}

fn tokenize(text: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            _ if c.is_whitespace() => i += 1,
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                tokens.push(Token::Defines);
                i += 3;
            }
            '"' => {
                let mut literal = String::new();
                i += 1;
                loop {
                    match chars.get(i) {
                        None => return Err("a string literal is not closed".into()),
                        Some('"') => break,
                        Some('\\') => {
                            let (ch, next) = escape(&chars, i)?;
                            literal.push(ch);
                            i = next;
                        }
                        Some(&ch) => {
                            literal.push(ch);
                            i += 1;
                        }
                    }
                }
                tokens.push(Token::Literal(literal));
                i += 1;
            }
            '[' => {
                i += 1;
                let negated = chars.get(i) == Some(&'^');
                if negated {
                    i += 1;
                }
                let mut ranges = Vec::new();
                loop {
                    let lo = match chars.get(i) {
                        None => return Err("a character class is not closed".into()),
                        Some(']') => break,
                        Some('\\') => {
                            let (ch, next) = escape(&chars, i)?;
                            i = next;
                            ch
                        }
                        Some(&ch) => {
                            i += 1;
                            ch
                        }
                    };
                    let mut hi = lo;
                    if chars.get(i) == Some(&'-') && chars.get(i + 1).is_some_and(|&n| n != ']') {
                        i += 1;
                        hi = if chars[i] == '\\' {
                            let (ch, next) = escape(&chars, i)?;
                            i = next;
                            ch
                        } else {
                            i += 1;
                            chars[i - 1]
                        };
                        if hi < lo {
                            return Err(format!("character range {lo:?}-{hi:?} is reversed"));
                        }
                    }
                    ranges.push((lo, hi));
                }
                if ranges.is_empty() && !negated {
                    return Err("an empty character class matches nothing".into());
                }
                tokens.push(Token::Class(negated, ranges));
                i += 1;
            }
            '.' => {
                tokens.push(Token::Any);
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                tokens.push(Token::Symbol(c.to_string()));
                i += 1;
            }
            '{' => {
                let close = chars[i..]
                    .iter()
                    .position(|&ch| ch == '}')
                    .ok_or("a `{` bound is not closed")?;
                let bound: String = chars[i + 1..i + close].iter().collect();
                let ok = !bound.is_empty()
                    && bound.split(',').count() <= 2
                    && bound.split(',').enumerate().all(|(k, n)| {
                        n.trim().parse::<u32>().is_ok() || (k == 1 && n.trim().is_empty())
                    });
                if !ok {
                    return Err(format!("`{{{bound}}}` is not a repetition bound"));
                }
                tokens.push(Token::Symbol(format!("{{{}}}", bound.replace(' ', ""))));
                i += close + 1;
            }
            _ if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '-' || chars[i] == '_')
                {
                    i += 1;
                }
                tokens.push(Token::Name(chars[start..i].iter().collect()));
            }
            _ => return Err(format!("unexpected character {c:?}")),
        }
    }
    Ok(tokens)
}

/// The char an escape at `chars[at]` (a backslash) stands for, and where
/// the text goes on.
fn escape(chars: &[char], at: usize) -> Result<(char, usize), String> {
    let hex = |len: usize| -> Result<(char, usize), String> {
        let digits: String = chars
            .get(at + 2..at + 2 + len)
            .unwrap_or(&[])
            .iter()
            .collect();
        u32::from_str_radix(&digits, 16)
            .ok()
            .filter(|_| digits.len() == len)
            .and_then(char::from_u32)
            .map(|ch| (ch, at + 2 + len))
            .ok_or_else(|| format!("bad escape \\{}{digits}", chars[at + 1]))
    };
    match chars.get(at + 1) {
        Some('n') => Ok(('\n', at + 2)),
        Some('r') => Ok(('\r', at + 2)),
        Some('t') => Ok(('\t', at + 2)),
        Some('x') => hex(2),
        Some('u') => hex(4),
        Some('U') => hex(8),
        Some(&ch) => Ok((ch, at + 2)),
        None => Err("a backslash ends the grammar".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_literals_classes_and_repeats_become_lark() {
        let gbnf = r#"
            # a comment
            root   ::= answer ws num{1,3} "."
            answer ::= ("yes" | "no")
            ws     ::= [ \t]+
            num    ::= [0-9] | [^a-z\]]?
            any-char ::= .
        "#;
        let lark = to_lark(gbnf).expect("converts");
        assert_eq!(
            lark,
            "start: r_0\n\
             r_0: r_1 r_2 r_3 {1,3} \".\"\n\
             r_1: ( \"yes\" | \"no\" )\n\
             r_2: /[\\x{20}\\x{9}]/ +\n\
             r_3: /[\\x{30}-\\x{39}]/ | /[^\\x{61}-\\x{7a}\\x{5d}]/ ?\n\
             r_4: /(?s:.)/\n"
        );
    }

    #[test]
    fn bad_grammars_say_why() {
        for (gbnf, why) in [
            ("answer ::= \"x\"", "no `root`"),
            ("root ::= missing", "undefined rule missing"),
            ("root ::= \"open", "not closed"),
            ("root ::= [z-a]", "reversed"),
            ("root ::= \"a\"{x}", "not a repetition bound"),
            ("root ::= \"a\"\nroot ::= \"b\"", "defined twice"),
            ("root ::= \"a\" %", "unexpected character"),
        ] {
            let e = to_lark(gbnf).expect_err(gbnf);
            assert!(e.contains(why), "{gbnf:?}: {e}");
        }
    }
}
