//! A shard's KV pages that outlive the process (`inferd shard --state-dir
//! DIR`). The shard's page pool is a file there (`kv.pages`), and a log
//! (`pages.log`) says, per session, where each full page of positions lies,
//! with a checksum of its bytes, and the hash chain of the session's tokens
//! up to the page's end that the coordinator sent with the hidden states.
//! A shard never sees tokens: the chains are how a coordinator, which
//! does, later names what it wants kept (a Resume frame).
//!
//! A page's checksum is seeded by a key derived from its chain, the
//! encoding of the hidden states it was computed from and the shard's
//! first layer, so a page rewritten since, torn by a crash, flipped on disk
//! or computed from other inputs fails its check at start-up and is
//! computed again.
//!
//! ```text
//! header  "INFERDS1" | version u32 | gguf sha256 [32] | layer begin u32
//!         | layer end u32 | page positions u32 | kv dim u32 | crc32c u32
//! record  as in a session journal (length, its complement, crc32c, kind)
//! kinds   1 Blocks: session id [16] | encoding u8 | chain count u32
//!                   | chains u64... | page hints (as a journal's Pages)
//!         2 Cut: session id [16] | blocks kept u32 (0: the session is gone)
//! ```
//!
//! The log is written without waiting for the disk (a lost record only
//! means pages computed again), rewritten whole at start-up to what was
//! verified, and again whenever it grows past twice what it must hold.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::frame::WireSessionId;
use super::payload::Encoding;
use crate::durable::{
    decode_hints, encode_hints, hints_bytes, lock_directory, next_record, private_options,
    private_state_dir, seal_record, start_record, NextRecord, PageHint, PageHints, PermissionError,
    RecordReader,
};

const MAGIC: &[u8; 8] = b"INFERDS1";
const VERSION: u32 = 1;
const KIND_BLOCKS: u8 = 1;
const KIND_CUT: u8 = 2;
/// A log this much larger than what it must hold is rewritten.
const COMPACT_SLACK: u64 = 1 << 20;
/// How much the log grows between two looks at whether to rewrite it.
const LOOK_EVERY: u64 = 64 << 10;

/// What computed the pages: a log of any other shard is not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub gguf_sha256: [u8; 32],
    pub layer_begin: u32,
    pub layer_end: u32,
    pub page_positions: u32,
    pub kv_dim: u32,
}

impl Identity {
    fn header(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(72);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.gguf_sha256);
        for v in [
            self.layer_begin,
            self.layer_end,
            self.page_positions,
            self.kv_dim,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// The key a block's page checksums are seeded by, from its chain.
    pub fn page_key(&self, chain: u64, encoding: Encoding) -> u64 {
        let mut bytes = [0u8; 5];
        bytes[..4].copy_from_slice(&self.layer_begin.to_le_bytes());
        bytes[4] = encoding_byte(encoding);
        xxh3_64_with_seed(&bytes, chain)
    }
}

fn encoding_byte(encoding: Encoding) -> u8 {
    match encoding {
        Encoding::F32 => 1,
        Encoding::F16 => 2,
        Encoding::Q8_0 => 3,
    }
}

fn encoding_of(byte: u8) -> Option<Encoding> {
    Some(match byte {
        1 => Encoding::F32,
        2 => Encoding::F16,
        3 => Encoding::Q8_0,
        _ => return None,
    })
}

/// What the log says of one session: the encoding its pages were computed
/// from, the chain of each of its first full blocks, and where their pages
/// lie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggedSession {
    pub encoding: Encoding,
    pub chains: Vec<u64>,
    pub hints: Vec<Box<[PageHint]>>,
}

/// Why the state directory cannot be used at all.
#[derive(Debug, thiserror::Error)]
pub enum KeptError {
    #[error("shard state directory {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("shard state directory {0} is in use by another process")]
    Locked(String),
    #[error("shard state directory: {0}")]
    Permissions(#[from] PermissionError),
}

/// What opening the directory found in its log.
#[derive(Debug, Default)]
pub struct Opened {
    /// Sessions the log names, with what it says of them.
    pub sessions: HashMap<WireSessionId, LoggedSession>,
    /// Why the whole log was set aside (another model, layer range or
    /// format), if it was.
    pub refused: Option<String>,
    /// Where damage stopped reading the log, if it did (what came before
    /// is used).
    pub damaged_at: Option<usize>,
}

/// The open state directory: its lock, and the log being appended to.
#[derive(Debug)]
pub struct StateDir {
    root: PathBuf,
    identity: Identity,
    log: Option<File>,
    log_bytes: u64,
    /// Log size at which [`StateDir::due`] says to look again.
    next_look: u64,
    _lock: File,
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> KeptError + '_ {
    move |source| KeptError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl StateDir {
    /// Opens (creating) `dir`, locks it and reads its log. A log written
    /// for another identity is reported in `refused` and not used.
    pub fn open(dir: &Path, identity: Identity) -> Result<(StateDir, Opened), KeptError> {
        // Private to this user, as a server's state directory is.
        private_state_dir(dir)?;
        let lock_path = dir.join("lock");
        let lock = lock_directory(dir)
            .map_err(io_error(&lock_path))?
            .ok_or_else(|| KeptError::Locked(dir.display().to_string()))?;
        let log_path = dir.join("pages.log");
        let opened = match std::fs::read(&log_path) {
            Ok(bytes) => replay(&bytes, &identity),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Opened::default(),
            Err(e) => return Err(io_error(&log_path)(e)),
        };
        let state = StateDir {
            root: dir.to_owned(),
            identity,
            log: None,
            log_bytes: 0,
            next_look: 0,
            _lock: lock,
        };
        Ok((state, opened))
    }

    /// The file that backs the shard's page pool.
    pub fn page_file(&self) -> PathBuf {
        self.root.join("kv.pages")
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Replaces the log with one that holds `sessions` alone (written
    /// beside it, then renamed over it). On failure the log is not
    /// appended to any more: pages are then not kept past a restart.
    pub fn rewrite<'a>(
        &mut self,
        sessions: impl Iterator<Item = (&'a WireSessionId, &'a LoggedSession)>,
    ) {
        self.log = None;
        let path = self.root.join("pages.log");
        let fresh = self.root.join("pages.log.new");
        let result = (|| -> std::io::Result<(File, u64)> {
            let mut bytes = self.identity.header();
            let mut record = Vec::new();
            for (id, session) in sessions {
                let hints = PageHints {
                    first_block: 0,
                    n_layers: session.hints.first().map_or(0, |h| h.len() as u32),
                    blocks: session.hints.clone(),
                };
                if hints.n_layers == 0 {
                    continue;
                }
                blocks_record(&mut record, id, session.encoding, &session.chains, &hints);
                bytes.extend_from_slice(&record);
            }
            let mut file = private_options()
                .create(true)
                .truncate(true)
                .write(true)
                .open(&fresh)?;
            file.write_all(&bytes)?;
            std::fs::rename(&fresh, &path)?;
            let file = private_options().append(true).open(&path)?;
            Ok((file, bytes.len() as u64))
        })();
        match result {
            Ok((file, len)) => {
                self.log = Some(file);
                self.log_bytes = len;
                self.next_look = len + LOOK_EVERY;
            }
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot write the shard's page log: pages will not be kept past a restart");
            }
        }
    }

    /// Appends that blocks `hints.first_block..` of `session` hold these
    /// pages, computed from hidden states in `encoding`, with these chains.
    pub fn log_blocks(
        &mut self,
        session: &WireSessionId,
        encoding: Encoding,
        chains: &[u64],
        hints: &PageHints,
    ) {
        let mut record = Vec::new();
        blocks_record(&mut record, session, encoding, chains, hints);
        self.append(&record);
    }

    /// Appends that `session` keeps only its first `blocks` blocks (0: it
    /// is gone).
    pub fn log_cut(&mut self, session: &WireSessionId, blocks: usize) {
        let mut record = Vec::new();
        start_record(&mut record, KIND_CUT, 20);
        record.extend_from_slice(session);
        record.extend_from_slice(&(blocks as u32).to_le_bytes());
        seal_record(&mut record);
        self.append(&record);
    }

    /// Whether the log grew enough since the last look to be worth
    /// comparing with what it must hold.
    pub fn due(&self) -> bool {
        self.log.is_some() && self.log_bytes >= self.next_look
    }

    /// Whether the log holds more than twice `needed` bytes (plus slack):
    /// time to [`StateDir::rewrite`] it.
    pub fn wants_rewrite(&mut self, needed: u64) -> bool {
        self.next_look = self.log_bytes + LOOK_EVERY;
        self.log.is_some() && self.log_bytes > 2 * needed + COMPACT_SLACK
    }

    /// Bytes a session's blocks take in a rewritten log.
    pub fn bytes_for(session: &LoggedSession) -> u64 {
        let hints: usize = session.hints.iter().map(|h| h.len()).sum();
        (13 + 16 + 1 + 4 + 8 * session.chains.len() + 12 + 12 * hints) as u64
    }

    fn append(&mut self, record: &[u8]) {
        let Some(log) = self.log.as_mut() else {
            return;
        };
        if let Err(e) = log.write_all(record) {
            // A record cut short mid-log would read as damage before the
            // ones after it: stop writing instead.
            tracing::error!(error = %e, "cannot append to the shard's page log: pages will not be kept past a restart");
            self.log = None;
            return;
        }
        self.log_bytes += record.len() as u64;
    }
}

fn blocks_record(
    out: &mut Vec<u8>,
    session: &WireSessionId,
    encoding: Encoding,
    chains: &[u64],
    hints: &PageHints,
) {
    let len = 16 + 1 + 4 + 8 * chains.len() + hints_bytes(hints);
    start_record(out, KIND_BLOCKS, len);
    out.extend_from_slice(session);
    out.push(encoding_byte(encoding));
    out.extend_from_slice(&(chains.len() as u32).to_le_bytes());
    for chain in chains {
        out.extend_from_slice(&chain.to_le_bytes());
    }
    encode_hints(out, hints);
    seal_record(out);
}

/// Reads a log: its header must name `identity`; records are applied in
/// order until the end, a torn last write, or damage.
fn replay(bytes: &[u8], identity: &Identity) -> Opened {
    let mut opened = Opened::default();
    let header = identity.header();
    if bytes.get(..header.len()) != Some(header.as_slice()) {
        opened.refused = Some(describe_mismatch(bytes, identity));
        return opened;
    }
    let mut r = RecordReader::new(bytes);
    r.at = header.len();
    loop {
        let start = r.at;
        match next_record(&mut r) {
            NextRecord::End | NextRecord::Torn => break,
            NextRecord::Damaged => {
                opened.damaged_at = Some(start);
                break;
            }
            NextRecord::Record(kind, payload) => {
                if apply(&mut opened.sessions, kind, payload).is_none() {
                    if r.at != bytes.len() {
                        opened.damaged_at = Some(start);
                    }
                    break;
                }
            }
        }
    }
    opened
}

/// Applies one record; `None` when it does not parse.
fn apply(
    sessions: &mut HashMap<WireSessionId, LoggedSession>,
    kind: u8,
    payload: &[u8],
) -> Option<()> {
    let mut r = RecordReader::new(payload);
    let id: WireSessionId = r.take(16)?.try_into().ok()?;
    match kind {
        KIND_BLOCKS => {
            let encoding = encoding_of(*r.take(1)?.first()?)?;
            let count = r.u32()? as usize;
            if count > payload.len() / 8 {
                return None;
            }
            let chains: Vec<u64> = (0..count).map(|_| r.u64()).collect::<Option<_>>()?;
            let hints = decode_hints(&mut r)?;
            if hints.blocks.len() != chains.len() {
                return None;
            }
            let first = hints.first_block as usize;
            let session = sessions.entry(id).or_insert_with(|| LoggedSession {
                encoding,
                chains: Vec::new(),
                hints: Vec::new(),
            });
            if first == 0 {
                session.encoding = encoding;
            }
            // A run past the blocks held, or in another encoding, cannot
            // continue them.
            if first <= session.chains.len() && session.encoding == encoding {
                session.chains.truncate(first);
                session.hints.truncate(first);
                session.chains.extend(chains);
                session.hints.extend(hints.blocks);
            }
        }
        KIND_CUT => {
            let blocks = r.u32()? as usize;
            if r.at != payload.len() {
                return None;
            }
            if blocks == 0 {
                sessions.remove(&id);
            } else if let Some(session) = sessions.get_mut(&id) {
                session.chains.truncate(blocks);
                session.hints.truncate(blocks);
            }
        }
        _ => return None,
    }
    Some(())
}

/// Why a log's header is not this shard's, in words.
fn describe_mismatch(bytes: &[u8], identity: &Identity) -> String {
    let mut r = RecordReader::new(bytes);
    if r.take(8) != Some(MAGIC.as_slice()) {
        return "pages.log is not a shard page log".into();
    }
    let Some(version) = r.u32() else {
        return "pages.log is cut short".into();
    };
    if version != VERSION {
        return format!("pages.log is format version {version}, this build reads {VERSION}");
    }
    let Some(sha) = r.take(32) else {
        return "pages.log is cut short".into();
    };
    if sha != identity.gguf_sha256 {
        return "pages.log was written for another model file".into();
    }
    let words: Vec<Option<u32>> = (0..4).map(|_| r.u32()).collect();
    match words[..] {
        [Some(begin), Some(end), Some(page), Some(dim)] => {
            if (begin, end) != (identity.layer_begin, identity.layer_end) {
                format!(
                    "pages.log holds layers {begin}..{end}, this shard runs {}..{}",
                    identity.layer_begin, identity.layer_end
                )
            } else if (page, dim) != (identity.page_positions, identity.kv_dim) {
                format!(
                    "pages.log pages {page} positions of {dim} values, this shard {} of {}",
                    identity.page_positions, identity.kv_dim
                )
            } else {
                "pages.log's header checksum does not match".into()
            }
        }
        _ => "pages.log is cut short".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            gguf_sha256: [3; 32],
            layer_begin: 4,
            layer_end: 9,
            page_positions: 16,
            kv_dim: 64,
        }
    }

    fn hints(first_block: u32, pages: &[u32]) -> PageHints {
        PageHints {
            first_block,
            n_layers: 2,
            blocks: pages
                .iter()
                .map(|&p| {
                    vec![
                        PageHint {
                            page: p,
                            checksum: u64::from(p) * 7,
                        },
                        PageHint {
                            page: p + 100,
                            checksum: 1,
                        },
                    ]
                    .into_boxed_slice()
                })
                .collect(),
        }
    }

    fn temp_dir() -> tempfile::TempDir {
        tempfile::tempdir().expect("temp dir")
    }

    #[test]
    fn the_log_gives_back_what_was_written_cut_and_continued() {
        let temp = temp_dir();
        let dir = temp.path();
        let (a, b) = ([1u8; 16], [2u8; 16]);
        {
            let (mut state, opened) = StateDir::open(dir, identity()).expect("opens");
            assert!(opened.sessions.is_empty() && opened.refused.is_none());
            state.rewrite(std::iter::empty());
            state.log_blocks(&a, Encoding::F32, &[10, 11], &hints(0, &[5, 6]));
            state.log_blocks(&a, Encoding::F32, &[12], &hints(2, &[7]));
            state.log_blocks(&b, Encoding::F16, &[20], &hints(0, &[8]));
            state.log_cut(&a, 1);
            state.log_blocks(&a, Encoding::F32, &[13], &hints(1, &[9]));
            state.log_blocks(&b, Encoding::F16, &[21], &hints(5, &[1]));
            // A continuation in another encoding, or past a gap, is ignored.
            state.log_blocks(&a, Encoding::F16, &[14], &hints(2, &[2]));
        }
        let (_state, opened) = StateDir::open(dir, identity()).expect("opens again");
        let got_a = &opened.sessions[&a];
        assert_eq!(got_a.chains, vec![10, 13]);
        assert_eq!(got_a.hints[1][0].page, 9);
        assert_eq!(opened.sessions[&b].chains, vec![20]);
        assert_eq!(opened.sessions[&b].encoding, Encoding::F16);
        assert_eq!(opened.damaged_at, None);
    }

    #[test]
    fn another_identity_is_refused_with_a_reason_and_damage_stops_the_replay() {
        let temp = temp_dir();
        let dir = temp.path();
        let a = [1u8; 16];
        {
            let (mut state, _) = StateDir::open(dir, identity()).expect("opens");
            state.rewrite(std::iter::empty());
            state.log_blocks(&a, Encoding::F32, &[10], &hints(0, &[5]));
            state.log_cut(&a, 0);
            state.log_blocks(&a, Encoding::F32, &[10], &hints(0, &[6]));
        }
        let other = Identity {
            layer_begin: 5,
            ..identity()
        };
        let (state, opened) = StateDir::open(dir, other).expect("opens");
        assert!(opened.sessions.is_empty());
        let why = opened.refused.expect("refused");
        assert!(why.contains("layers 4..9"), "{why}");
        drop(state);
        let log = dir.join("pages.log");
        let mut bytes = std::fs::read(&log).expect("log");
        let header = identity().header().len();
        // Damage in the second record: the first one still counts.
        let first = u32::from_le_bytes(bytes[header..header + 4].try_into().unwrap()) as usize;
        let second = header + 13 + first;
        bytes[second + 14] ^= 0x40;
        std::fs::write(&log, &bytes).expect("write");
        let (_state, opened) = StateDir::open(dir, identity()).expect("opens");
        assert_eq!(opened.damaged_at, Some(second));
        assert_eq!(opened.sessions[&a].hints[0][0].page, 5);
    }

    #[test]
    fn the_log_is_looked_at_again_only_once_it_grew() {
        let temp = temp_dir();
        let (mut state, _) = StateDir::open(temp.path(), identity()).expect("opens");
        assert!(!state.due(), "no log yet");
        state.rewrite(std::iter::empty());
        assert!(!state.due(), "just rewritten");
        let a = [1u8; 16];
        let mut block = 0;
        while !state.due() {
            state.log_blocks(&a, Encoding::F32, &[block], &hints(block as u32, &[5]));
            block += 1;
        }
        assert!(state.log_bytes >= LOOK_EVERY, "{} bytes", state.log_bytes);
        // Small next to what it must hold: kept, and not looked at again
        // until it grows once more.
        assert!(!state.wants_rewrite(state.log_bytes));
        assert!(!state.due());
        // Under the slack a log is kept even when it must hold nothing.
        assert!(state.log_bytes < COMPACT_SLACK);
        assert!(!state.wants_rewrite(0));
    }

    #[test]
    fn a_locked_directory_is_refused() {
        let temp = temp_dir();
        let dir = temp.path();
        let (_held, _) = StateDir::open(dir, identity()).expect("opens");
        assert!(matches!(
            StateDir::open(dir, identity()),
            Err(KeptError::Locked(_))
        ));
    }

    #[test]
    fn page_keys_differ_by_encoding_and_first_layer() {
        let id = identity();
        let f32_key = id.page_key(77, Encoding::F32);
        assert_ne!(f32_key, id.page_key(77, Encoding::F16));
        assert_ne!(f32_key, id.page_key(78, Encoding::F32));
        let later = Identity {
            layer_begin: 5,
            ..id
        };
        assert_ne!(f32_key, later.page_key(77, Encoding::F32));
    }
}
