//! The vocabulary's token texts, stored in one buffer, with an
//! open-addressing index from text to id. One allocation instead of one per
//! token keeps loading a 50k vocabulary to a few milliseconds.

use std::hash::BuildHasher;

use super::bpe::FastBuildHasher;

/// Marks an empty index slot.
const EMPTY: u32 = u32::MAX;

/// Token texts by id, and ids by text.
#[derive(Clone, Debug)]
pub struct TokenTexts {
    buf: String,
    /// `buf[starts[i]..starts[i + 1]]` is the text of token `i`.
    starts: Vec<usize>,
    /// Ids, placed by hash of their text with linear probing.
    slots: Vec<u32>,
}

impl TokenTexts {
    /// Indexes `texts`; ids are positions, so there must be fewer than
    /// `u32::MAX` of them. A text that occurs twice maps to its last id, as
    /// in llama.cpp.
    pub fn new(texts: &[String]) -> Self {
        let total: usize = texts.iter().map(String::len).sum();
        let mut buf = String::with_capacity(total);
        let mut starts = Vec::with_capacity(texts.len() + 1);
        for text in texts {
            starts.push(buf.len());
            buf.push_str(text);
        }
        starts.push(buf.len());
        let slot_count = (texts.len() * 2).next_power_of_two().max(2);
        let mut this = Self {
            buf,
            starts,
            slots: vec![EMPTY; slot_count],
        };
        for id in 0..texts.len() {
            this.insert(id as u32);
        }
        this
    }

    pub fn len(&self) -> usize {
        self.starts.len() - 1
    }

    /// The text of token `id`.
    pub fn get(&self, id: u32) -> Option<&str> {
        let i = id as usize;
        let (start, end) = (*self.starts.get(i)?, *self.starts.get(i + 1)?);
        self.buf.get(start..end)
    }

    /// Every text, in id order.
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        self.starts.windows(2).map(|w| &self.buf[w[0]..w[1]])
    }

    /// The id whose text is exactly `text`.
    pub fn id_of(&self, text: &str) -> Option<u32> {
        let mask = self.slots.len() - 1;
        let mut at = self.home(text);
        loop {
            let id = self.slots[at];
            if id == EMPTY {
                return None;
            }
            if self.get(id) == Some(text) {
                return Some(id);
            }
            at = (at + 1) & mask;
        }
    }

    fn home(&self, text: &str) -> usize {
        (FastBuildHasher::default().hash_one(text) as usize) & (self.slots.len() - 1)
    }

    fn insert(&mut self, id: u32) {
        let mask = self.slots.len() - 1;
        let text = self.get(id).unwrap_or_default();
        let mut at = self.home(text);
        loop {
            let other = self.slots[at];
            if other == EMPTY || self.get(other) == Some(text) {
                self.slots[at] = id;
                return;
            }
            at = (at + 1) & mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn finds_every_text_and_nothing_else() {
        let list: Vec<String> = (0..1000).map(|i| format!("tok{i}")).collect();
        let texts = TokenTexts::new(&list);
        assert_eq!(texts.len(), 1000);
        for (i, t) in list.iter().enumerate() {
            assert_eq!(texts.id_of(t), Some(i as u32));
            assert_eq!(texts.get(i as u32), Some(t.as_str()));
        }
        assert_eq!(texts.id_of("tok1000"), None);
        assert_eq!(texts.get(1000), None);
        assert_eq!(texts.iter().nth(7), Some("tok7"));
    }

    #[test]
    fn duplicate_text_maps_to_last_id() {
        let texts = TokenTexts::new(&strings(&["a", "", "a", "b"]));
        assert_eq!(texts.id_of("a"), Some(2));
        assert_eq!(texts.id_of(""), Some(1));
        assert_eq!(texts.get(0), Some("a"));
    }

    #[test]
    fn empty_vocabulary() {
        let texts = TokenTexts::new(&[]);
        assert_eq!(texts.len(), 0);
        assert_eq!(texts.id_of("x"), None);
    }
}
