//! The GPT-2 byte-level alphabet: every byte maps to one printable Unicode
//! character, so that BPE vocabularies can be stored as text. Printable
//! Latin-1 bytes stand for themselves; the other 68 bytes (controls, space,
//! DEL, NBSP, soft hyphen) map to U+0100 onwards, in byte order.

/// The character byte `b` is written as inside vocabulary text.
pub fn byte_to_char(b: u8) -> char {
    BYTE_TO_CHAR[usize::from(b)]
}

/// The byte a vocabulary character stands for, if it is in the alphabet.
pub fn char_to_byte(c: char) -> Option<u8> {
    CHAR_TO_BYTE.get(c as usize).copied().flatten()
}

/// Whether the byte is in the printable ranges that map to themselves.
const fn maps_to_itself(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// Size of the reverse table: U+0000 up to the last remapped character.
const CHAR_TABLE_LEN: usize = 256 + 68;

const BYTE_TO_CHAR: [char; 256] = {
    let mut table = ['\0'; 256];
    let mut next_remapped = 256u32;
    let mut b = 0usize;
    while b < 256 {
        let code = if maps_to_itself(b as u8) {
            b as u32
        } else {
            next_remapped += 1;
            next_remapped - 1
        };
        table[b] = match char::from_u32(code) {
            Some(c) => c,
            None => '\0',
        };
        b += 1;
    }
    table
};

const CHAR_TO_BYTE: [Option<u8>; CHAR_TABLE_LEN] = {
    let mut table = [None; CHAR_TABLE_LEN];
    let mut b = 0usize;
    while b < 256 {
        table[BYTE_TO_CHAR[b] as usize] = Some(b as u8);
        b += 1;
    }
    table
};

/// Decodes vocabulary text to the bytes it stands for. Characters outside
/// the alphabet (which a well-formed vocabulary never holds) are kept as
/// their own UTF-8 bytes rather than dropped.
pub fn decode_text(text: &str, out: &mut Vec<u8>) {
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_mappings() {
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(b' '), '\u{120}'); // "Ġ"
        assert_eq!(byte_to_char(b'\n'), '\u{10A}'); // "Ċ"
        assert_eq!(byte_to_char(0), '\u{100}');
        assert_eq!(byte_to_char(0xAD), '\u{143}');
        assert_eq!(byte_to_char(0xFF), 'ÿ');
    }

    #[test]
    fn round_trips_every_byte() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert!(seen.insert(c), "byte {b} maps to a repeated char");
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(char_to_byte('€'), None);
    }

    #[test]
    fn decodes_text() {
        let mut out = Vec::new();
        decode_text("\u{120}hi\u{10A}€", &mut out);
        assert_eq!(out, b" hi\n\xe2\x82\xac");
    }
}
