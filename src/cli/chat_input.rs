//! Where `inferd chat` reads the user's lines from: at a terminal, a line
//! editor (rustyline: editing keys, and a history kept across chats in
//! `$XDG_STATE_HOME/inferd/chat_history`, else
//! `~/.local/state/inferd/chat_history`); from a pipe or a file, plain
//! lines.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use rustyline::error::ReadlineError;
use rustyline::DefaultEditor;

use super::CliError;

/// Most lines the history file keeps.
const HISTORY_LINES: usize = 1000;

/// One line of input, or why there is none.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    Text(String),
    /// End of input (Ctrl-D at the terminal).
    End,
    /// Ctrl-C at the prompt.
    Interrupted,
}

/// See the module docs.
pub enum ChatInput {
    Editor {
        editor: Box<DefaultEditor>,
        history: Option<PathBuf>,
    },
    Lines,
}

fn history_file() -> Option<PathBuf> {
    let state = std::env::var_os("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))?;
    Some(state.join("inferd").join("chat_history"))
}

impl ChatInput {
    /// The editor when stdin and stdout are a terminal, plain lines
    /// otherwise.
    pub fn new() -> ChatInput {
        if !(std::io::stdin().is_terminal() && std::io::stdout().is_terminal()) {
            return ChatInput::Lines;
        }
        let config = rustyline::Config::builder()
            .max_history_size(HISTORY_LINES)
            .and_then(|b| b.history_ignore_dups(true))
            .map(|b| b.history_ignore_space(true).auto_add_history(true).build());
        let editor = config.and_then(DefaultEditor::with_config);
        match editor {
            Ok(mut editor) => {
                let history = history_file();
                if let Some(path) = &history {
                    // A first chat has no history yet.
                    let _ = editor.load_history(path);
                }
                ChatInput::Editor {
                    editor: Box::new(editor),
                    history,
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "no line editor: reading plain lines");
                ChatInput::Lines
            }
        }
    }

    /// Shows `prompt` and reads the next line.
    pub fn read(&mut self, prompt: &str) -> Result<Line, CliError> {
        match self {
            ChatInput::Editor { editor, .. } => match editor.readline(prompt) {
                Ok(text) => Ok(Line::Text(text)),
                Err(ReadlineError::Eof) => Ok(Line::End),
                Err(ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(e) => Err(CliError::Io(std::io::Error::other(e.to_string()))),
            },
            ChatInput::Lines => {
                let mut out = std::io::stdout();
                write!(out, "{prompt}")?;
                out.flush()?;
                let mut line = String::new();
                if std::io::stdin().lock().read_line(&mut line)? == 0 {
                    return Ok(Line::End);
                }
                Ok(Line::Text(line.trim_end_matches(['\n', '\r']).to_owned()))
            }
        }
    }

    /// Keeps the history for the next chat (best effort).
    pub fn save_history(&mut self) {
        if let ChatInput::Editor {
            editor,
            history: Some(path),
        } = self
        {
            if let Some(dir) = path.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            if let Err(e) = editor.save_history(path) {
                tracing::warn!(path = %path.display(), error = %e, "saving the chat history");
            }
        }
    }
}
