//! `inferd tokenize`: text to token ids and back with a model's vocabulary
//! alone, for scripts and for checking a tokenizer by hand. Only the GGUF
//! metadata is read, so vocabulary-only files (no tensors) work too.

use std::io::Write;
use std::path::PathBuf;

use clap::{ArgGroup, Args};

use super::{load_tokenizer, CliError, DEFAULT_MODEL};
use crate::tokenizer::Tokenizer;

#[derive(Debug, Args)]
#[command(group(ArgGroup::new("input").required(true).args(["text", "ids"])))]
pub struct TokenizeArgs {
    /// GGUF file with the vocabulary (a full model or a vocabulary-only
    /// file) [default: the reference model in models/, or $INFERD_MODEL].
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Text to encode; prints its token ids, space-separated, on one line.
    #[arg(long)]
    pub text: Option<String>,
    /// Token ids to decode, separated by commas or spaces; prints the text
    /// exactly (no newline is added).
    #[arg(long)]
    pub ids: Option<String>,
    /// Encoding: add no BOS/EOS and read special-token text such as
    /// `<|im_end|>` as plain text. Decoding: leave control tokens out.
    /// Without it, encoding adds BOS/EOS as the model asks and turns
    /// special-token text into its token, and decoding shows control
    /// tokens as their text.
    #[arg(long)]
    pub no_special: bool,
}

pub fn run(args: TokenizeArgs) -> Result<(), CliError> {
    let path = args
        .model
        .or_else(|| std::env::var_os("INFERD_MODEL").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_MODEL));
    let tokenizer = load_tokenizer(&path)?;
    let special = !args.no_special;
    let out = match (args.text, args.ids) {
        (Some(text), _) => {
            let ids = tokenizer.encode(&text, special, special)?;
            let mut line = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
            line.push('\n');
            line
        }
        (None, Some(list)) => decode(&tokenizer, &parse_ids(&list)?, special)?,
        (None, None) => return Err(CliError::Usage("give --text or --ids".into())),
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()?;
    Ok(())
}

/// Ids separated by commas and/or whitespace ("1,2,3", "1 2 3").
fn parse_ids(list: &str) -> Result<Vec<u32>, CliError> {
    list.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse()
                .map_err(|_| CliError::Usage(format!("--ids: {s:?} is not a token id")))
        })
        .collect()
}

/// The text of `ids`; without `special`, control tokens are left out.
fn decode(tokenizer: &Tokenizer, ids: &[u32], special: bool) -> Result<String, CliError> {
    if special {
        return Ok(tokenizer.decode(ids)?);
    }
    let kept: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&id| !tokenizer.is_control(id))
        .collect();
    Ok(tokenizer.decode(&kept)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_with_commas_or_spaces() {
        assert_eq!(parse_ids("1,2,3").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids(" 1 2\n3 ").unwrap(), [1, 2, 3]);
        assert_eq!(parse_ids("1, 2,,3").unwrap(), [1, 2, 3]);
        assert!(parse_ids("").unwrap().is_empty());
        assert!(matches!(parse_ids("1,x"), Err(CliError::Usage(m)) if m.contains("\"x\"")));
        assert!(parse_ids("-1").is_err());
    }
}
