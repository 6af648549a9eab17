//! The OpenAI `stop` strings: text, not tokens, so a stop string may span
//! tokens or end inside one. Generated text passes through [`StopText`],
//! which holds back only what could still be the start of a stop string
//! and cuts the text where the first one begins.

/// See the module docs.
#[derive(Debug, Default)]
pub struct StopText {
    stops: Vec<String>,
    held: String,
}

impl StopText {
    /// Empty strings are ignored.
    pub fn new(stops: Vec<String>) -> StopText {
        StopText {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Takes the next piece of generated text; returns the text that can
    /// be sent now and whether a stop string was found (the text before it
    /// is in what is returned, the stop string and what follows are not).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.held[..at].to_owned();
            self.held.clear();
            return (out, true);
        }
        // The earliest place from which the held text could still grow
        // into a stop string.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let out = self.held[..keep_from].to_owned();
        self.held.drain(..keep_from);
        (out, false)
    }

    /// What is still held when the generation ends without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut text = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            let (sent, stopped) = text.push(piece);
            out.push_str(&sent);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&text.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_across_pieces_cuts_the_text_where_it_begins() {
        assert_eq!(
            run(&["\n\n"], &["Hello", " world\n", "\nmore"]),
            ("Hello world".into(), true)
        );
        assert_eq!(
            run(&["END", "stop"], &["a st", "ops", " END"]),
            ("a ".into(), true)
        );
        assert_eq!(run(&["xyz"], &["abc", "xy"]), ("abcxy".into(), false));
        assert_eq!(run(&[], &["abc"]), ("abc".into(), false));
    }

    #[test]
    fn only_what_could_start_a_stop_string_is_held_back() {
        let mut text = StopText::new(vec!["</answer>".into()]);
        assert_eq!(
            text.push("The answer is 4</"),
            ("The answer is 4".into(), false)
        );
        assert_eq!(text.push("b>"), ("</b>".into(), false));
        assert_eq!(text.push("é</ans"), ("é".into(), false));
        assert_eq!(text.push("wer> tail"), (String::new(), true));
    }
}
