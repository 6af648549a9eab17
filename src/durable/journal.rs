//! The bytes of one session's journal file: a header naming the session and
//! the model it was computed with, then records that each change the
//! committed history. Everything is little-endian and every piece carries a
//! CRC-32C, so a reader can tell a torn tail (the last write cut short by a
//! crash: its data was never acknowledged under `sync`) from damage in the
//! middle (the history after it is unknown: the session is refused, never
//! restored short).
//!
//! ```text
//! header  "INFERDJ1" | version u32 | model sha256 [32] | session id [16]
//!         | eos count u32 | eos ids u32... | label length u32 | label bytes
//!         | owner length u32 | owner bytes (version 2 on; 0 bytes: no owner)
//!         | crc32c u32 (of everything before it)
//! record  payload length u32 | its bitwise complement u32
//!         | crc32c u32 (of kind and payload) | kind u8
//!         | payload (by kind)
//! kinds   1 Append: token count u32 | token ids u32... (they follow the history)
//!         2 Reset: the same payload (the tokens replace the history)
//!         3 Pages: first block u32 | block count u32 | layers u32
//!                  | (pool page u32 | checksum u64) per layer per block
//!         4 Digest: the logits digest u64 of the history so far
//! ```
//!
//! A Pages record is a hint, not history: where the KV of the history's
//! full pages (blocks of `page_positions` positions) lies in the state
//! directory's page file, each page with a checksum that binds its bytes to
//! the tokens up to its end (see `pages.rs`). It replaces the hints from its
//! first block on. Hints and digests are written without waiting for the
//! disk, so they live in a file of their own beside the journal
//! (`hints.rs`): a journal holds only records that were synced in order,
//! and a hint lost, torn or stale only means that page is computed again.
//! Journals written before that split hold kinds 3 and 4 too; they are
//! still read.
//!
//! A bad record (cut short, failing its checksum, or misshapen) with no
//! record that passes its checks anywhere after it is a torn tail: what a
//! crash or a power cut leaves at the end of a file (a write cut short,
//! zeros from a block the file system allocated but never filled, garbage).
//! It is dropped. A bad record followed by a good one is damage in the
//! middle: the history after it is unknown and the journal is refused.
//!
//! The owner is the tenant the session belongs to (CONTRACT §2.10): a
//! token's name or a digest of it, never a token. Version 1 journals,
//! written before sessions had owners, are still read: their sessions have
//! no owner.

use thiserror::Error;

use crate::base::Tenant;

/// The first bytes of every journal file.
pub const MAGIC: &[u8; 8] = b"INFERDJ1";
/// The format of the records after the magic; a reader refuses others
/// except [`VERSION_WITHOUT_OWNER`].
pub const VERSION: u32 = 2;
/// The format before headers named an owner: read, never written.
pub const VERSION_WITHOUT_OWNER: u32 = 1;
/// Most bytes of one record's payload: a full context of 2^20 tokens.
const MAX_PAYLOAD: usize = 4 + 4 * (1 << 20);
/// Bytes before a record's payload: length twice, checksum, kind.
const RECORD_HEAD: usize = 13;

/// Who a journal belongs to and what computed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub model_sha256: [u8; 32],
    pub session: [u8; 16],
    pub eos: Vec<u32>,
    pub label: String,
    /// The tenant the session belongs to ([`Tenant::NONE`]: anyone's).
    pub owner: Tenant,
}

/// One change to the committed history, or a hint about its pages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// Tokens appended (by an append or a Generate).
    Append(Vec<u32>),
    /// The whole history, replacing the old one (a truncation, or the
    /// first record of a fork).
    Reset(Vec<u32>),
    /// Where full pages of the history lie in the page file.
    Pages(PageHints),
    /// The digest of the next-token logits of the history so far (what
    /// GetSessionInfo reports), so a session restored without computing
    /// them reports it too; any later history record voids it.
    Digest(u64),
}

/// The pool pages of consecutive full blocks of a history, one per layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageHints {
    /// The block (`history[block * page_positions..]`) the first row is for.
    pub first_block: u32,
    /// Layers per block: the length of every row.
    pub n_layers: u32,
    /// One row per block, in block order.
    pub blocks: Vec<Box<[PageHint]>>,
}

/// Where one layer's page of one block lies, and what its bytes hash to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageHint {
    /// The page's index in the pool, or [`PageHint::ABSENT`] when a
    /// sliding-window layer had given it back.
    pub page: u32,
    pub checksum: u64,
}

impl PageHint {
    /// The `page` of a layer that holds no page for the block.
    pub const ABSENT: u32 = u32::MAX;
}

/// Most blocks one history can have hints for (a context of 2^20 tokens in
/// pages of one position).
pub const MAX_HINTED_BLOCKS: usize = 1 << 20;
/// Bytes of one hint in a Pages record.
const HINT_BYTES: usize = 12;
/// Most hints one Pages record carries; writers split longer runs.
pub const MAX_HINTS_PER_RECORD: usize = (MAX_PAYLOAD - 12) / HINT_BYTES;

/// Why a journal's bytes cannot be read (the session is not restored).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum JournalError {
    #[error("not a session journal (bad magic)")]
    BadMagic,
    #[error("journal format version {0}, this build reads {VERSION}")]
    Version(u32),
    #[error("the header is cut short or its checksum does not match")]
    BadHeader,
    #[error("a record at byte {offset} is damaged and more follow it")]
    DamagedRecord { offset: usize },
}

/// What reading a journal found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replayed {
    pub header: Header,
    /// The committed history the records add up to.
    pub history: Vec<u32>,
    /// Page hints for the history's first blocks, in block order (only a
    /// run from block 0 is kept: a block after a gap cannot be used).
    pub hints: Vec<Box<[PageHint]>>,
    /// The logits digest of `history`, if the journal recorded it after
    /// the history's last change.
    pub digest: Option<u64>,
    /// Bytes of whole, verified records (header included): where the next
    /// record goes.
    pub good_len: usize,
    /// Bytes of the header.
    pub header_len: usize,
    /// Bytes after them that were a torn last write and are dropped.
    pub torn_bytes: usize,
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// The header's bytes.
pub fn encode_header(header: &Header) -> Vec<u8> {
    let owner = header.owner.identity().unwrap_or_default();
    let mut out = Vec::with_capacity(100 + header.label.len() + owner.len() + 4 * header.eos.len());
    out.extend_from_slice(MAGIC);
    put_u32(&mut out, VERSION);
    out.extend_from_slice(&header.model_sha256);
    out.extend_from_slice(&header.session);
    put_u32(&mut out, header.eos.len() as u32);
    for &id in &header.eos {
        put_u32(&mut out, id);
    }
    put_u32(&mut out, header.label.len() as u32);
    out.extend_from_slice(header.label.as_bytes());
    put_u32(&mut out, owner.len() as u32);
    out.extend_from_slice(owner.as_bytes());
    let crc = crc32c::crc32c(&out);
    put_u32(&mut out, crc);
    out
}

/// One record's bytes. A Pages record must hold at most
/// [`MAX_HINTS_PER_RECORD`] hints.
pub fn encode_record(record: &Record) -> Vec<u8> {
    let (kind, payload_len) = match record {
        Record::Append(t) => (1u8, 4 + 4 * t.len()),
        Record::Reset(t) => (2u8, 4 + 4 * t.len()),
        Record::Pages(h) => (3u8, hints_bytes(h)),
        Record::Digest(_) => (4u8, 8),
    };
    let mut out = Vec::with_capacity(RECORD_HEAD + payload_len);
    start_record(&mut out, kind, payload_len);
    match record {
        Record::Append(tokens) | Record::Reset(tokens) => {
            put_u32(&mut out, tokens.len() as u32);
            for &t in tokens {
                put_u32(&mut out, t);
            }
        }
        Record::Pages(hints) => encode_hints(&mut out, hints),
        Record::Digest(digest) => out.extend_from_slice(&digest.to_le_bytes()),
    }
    seal_record(&mut out);
    out
}

/// Bytes of a Pages payload (or of the hints that end another log's
/// record) holding `hints`.
pub(crate) fn hints_bytes(hints: &PageHints) -> usize {
    12 + HINT_BYTES * hints.blocks.iter().map(|b| b.len()).sum::<usize>()
}

/// Writes a Pages payload.
pub(crate) fn encode_hints(out: &mut Vec<u8>, hints: &PageHints) {
    put_u32(out, hints.first_block);
    put_u32(out, hints.blocks.len() as u32);
    put_u32(out, hints.n_layers);
    for hint in hints.blocks.iter().flat_map(|b| b.iter()) {
        put_u32(out, hint.page);
        out.extend_from_slice(&hint.checksum.to_le_bytes());
    }
}

/// Starts a record of `kind` whose payload of `payload_len` bytes the
/// caller appends next; [`seal_record`] then fills in its checksum.
pub(crate) fn start_record(out: &mut Vec<u8>, kind: u8, payload_len: usize) {
    out.clear();
    put_u32(out, payload_len as u32);
    // A length with a flipped bit must read as damage, not as a record
    // running past the end (a torn write).
    put_u32(out, !(payload_len as u32));
    put_u32(out, 0);
    out.push(kind);
}

/// Fills in the checksum of a record started by [`start_record`] whose
/// payload is complete.
pub(crate) fn seal_record(out: &mut [u8]) {
    let crc = crc32c::crc32c(&out[12..]);
    out[8..12].copy_from_slice(&crc.to_le_bytes());
}

/// What the bytes at a reader's position hold.
pub(crate) enum NextRecord<'a> {
    /// Nothing: the end of the file.
    End,
    /// A record cut short, or failing its checksum, with nothing after it:
    /// a write a crash tore.
    Torn,
    /// A bad record with more bytes after it.
    Damaged,
    /// A whole record: its kind and payload.
    Record(u8, &'a [u8]),
}

/// Reads the record at `r`'s position and moves past it.
pub(crate) fn next_record<'a>(r: &mut Reader<'a>) -> NextRecord<'a> {
    let bytes = r.bytes;
    if r.at == bytes.len() {
        return NextRecord::End;
    }
    let (Some(len), Some(check), Some(crc)) = (r.u32(), r.u32(), r.u32()) else {
        return NextRecord::Torn;
    };
    let len = len as usize;
    if check != !(len as u32) || len > MAX_PAYLOAD {
        return NextRecord::Damaged;
    }
    let Some(body) = r.take(1 + len) else {
        // A length past the end: the write was cut short.
        return NextRecord::Torn;
    };
    match body.split_first() {
        Some((&kind, payload)) if crc32c::crc32c(body) == crc => NextRecord::Record(kind, payload),
        _ if r.at == bytes.len() => NextRecord::Torn,
        _ => NextRecord::Damaged,
    }
}

/// Whether a record that passes every check (framing, checksum, and the
/// shape `decode` asks of its kind) begins anywhere in `bytes[from..]`.
/// After a bad record, none means the rest is a torn tail; one means the
/// bad record is damage in the middle. A random position passes the
/// length's complement check once in 2^32, so the scan costs about one
/// comparison per byte.
pub(crate) fn good_record_after<T>(
    bytes: &[u8],
    from: usize,
    decode: impl Fn(u8, &[u8]) -> Option<T>,
) -> bool {
    (from..bytes.len()).any(|at| {
        let mut r = Reader { bytes, at };
        matches!(next_record(&mut r), NextRecord::Record(kind, payload) if decode(kind, payload).is_some())
    })
}

/// Reads little-endian words off a byte slice.
pub(crate) struct Reader<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }

    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let got = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(got)
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
    }

    fn tokens(&mut self, count: usize) -> Option<Vec<u32>> {
        let bytes = self.take(count.checked_mul(4)?)?;
        Some(
            bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        )
    }
}

fn parse_header(r: &mut Reader<'_>) -> Result<Header, JournalError> {
    if r.take(MAGIC.len()) != Some(MAGIC.as_slice()) {
        return Err(JournalError::BadMagic);
    }
    let version = r.u32().ok_or(JournalError::BadHeader)?;
    if version != VERSION && version != VERSION_WITHOUT_OWNER {
        return Err(JournalError::Version(version));
    }
    let bad = || JournalError::BadHeader;
    let model_sha256: [u8; 32] = r.take(32).ok_or_else(bad)?.try_into().map_err(|_| bad())?;
    let session: [u8; 16] = r.take(16).ok_or_else(bad)?.try_into().map_err(|_| bad())?;
    let eos_count = r.u32().ok_or_else(bad)? as usize;
    let eos = r.tokens(eos_count).ok_or_else(bad)?;
    let label_len = r.u32().ok_or_else(bad)? as usize;
    let label = r.take(label_len).ok_or_else(bad)?.to_vec();
    let owner = if version == VERSION_WITHOUT_OWNER {
        &[][..]
    } else {
        let owner_len = r.u32().ok_or_else(bad)? as usize;
        r.take(owner_len).ok_or_else(bad)?
    };
    let covered = r.at;
    let crc = r.u32().ok_or_else(bad)?;
    if crc != crc32c::crc32c(&r.bytes[..covered]) {
        return Err(bad());
    }
    let label = String::from_utf8(label).map_err(|_| bad())?;
    let owner = match owner {
        [] => Tenant::NONE,
        bytes => std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| Tenant::new(text).ok())
            .ok_or_else(bad)?,
    };
    Ok(Header {
        model_sha256,
        session,
        eos,
        label,
        owner,
    })
}

/// Replays a journal: its header and the history its records add up to. A
/// record that is cut short, fails its checksum or is misshapen is a torn
/// tail when no good record follows it (dropped with everything after it,
/// and reported in `torn_bytes`), and damage (the whole journal refused)
/// when one does.
pub fn replay(bytes: &[u8]) -> Result<Replayed, JournalError> {
    let mut r = Reader { bytes, at: 0 };
    let header = parse_header(&mut r)?;
    let header_len = r.at;
    let mut history = Vec::new();
    let mut hints: Vec<Box<[PageHint]>> = Vec::new();
    let mut digest = None;
    loop {
        let start = r.at;
        let torn = |history: Vec<u32>, hints: Vec<Box<[PageHint]>>, header: Header| Replayed {
            header,
            history,
            hints,
            digest,
            good_len: start,
            header_len,
            torn_bytes: bytes.len() - start,
        };
        let record = match next_record(&mut r) {
            NextRecord::End => break,
            NextRecord::Torn | NextRecord::Damaged => None,
            NextRecord::Record(kind, payload) => decode_body(kind, payload),
        };
        match record {
            Some(Record::Append(tokens)) => {
                history.extend_from_slice(&tokens);
                digest = None;
            }
            Some(Record::Reset(tokens)) => {
                history = tokens;
                hints.clear();
                digest = None;
            }
            Some(Record::Digest(d)) => digest = Some(d),
            Some(Record::Pages(run)) => {
                // A run that starts past the hints held leaves a gap: the
                // blocks after it could never be adopted.
                let first = run.first_block as usize;
                if first <= hints.len() {
                    hints.truncate(first);
                    hints.extend(run.blocks);
                }
            }
            None if good_record_after(bytes, start + 1, decode_body) => {
                return Err(JournalError::DamagedRecord { offset: start })
            }
            None => return Ok(torn(history, hints, header)),
        }
    }
    Ok(Replayed {
        header,
        history,
        hints,
        digest,
        good_len: bytes.len(),
        header_len,
        torn_bytes: 0,
    })
}

/// A record's kind and payload, checked for shape.
fn decode_body(kind: u8, payload: &[u8]) -> Option<Record> {
    let mut r = Reader::new(payload);
    let record = match kind {
        1 | 2 => {
            let count = r.u32()? as usize;
            let tokens = r.tokens(count)?;
            if kind == 1 {
                Record::Append(tokens)
            } else {
                Record::Reset(tokens)
            }
        }
        3 => Record::Pages(decode_hints(&mut r)?),
        4 => Record::Digest(r.u64()?),
        _ => return None,
    };
    (r.at == payload.len()).then_some(record)
}

/// A Pages record's payload (the rest of `r`), checked for shape and
/// bounds.
pub(crate) fn decode_hints(r: &mut Reader<'_>) -> Option<PageHints> {
    let first_block = r.u32()?;
    let n_blocks = r.u32()? as usize;
    let n_layers = r.u32()?;
    if n_layers == 0 || (first_block as usize).checked_add(n_blocks)? > MAX_HINTED_BLOCKS {
        return None;
    }
    let count = n_blocks.checked_mul(n_layers as usize)?;
    // The payload length was bounded before: this cannot allocate more
    // than it holds.
    if r.bytes.len() - r.at != count.checked_mul(HINT_BYTES)? {
        return None;
    }
    let blocks = (0..n_blocks)
        .map(|_| {
            (0..n_layers)
                .map(|_| {
                    Some(PageHint {
                        page: r.u32()?,
                        checksum: r.u64()?,
                    })
                })
                .collect::<Option<Box<[PageHint]>>>()
        })
        .collect::<Option<Vec<_>>>()?;
    Some(PageHints {
        first_block,
        n_layers,
        blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            model_sha256: [7; 32],
            session: [9; 16],
            eos: vec![2, 3],
            label: "agent ü".into(),
            owner: Tenant::new("alice").unwrap(),
        }
    }

    fn journal(records: &[Record]) -> Vec<u8> {
        let mut bytes = encode_header(&header());
        for r in records {
            bytes.extend(encode_record(r));
        }
        bytes
    }

    #[test]
    fn records_replay_to_the_history_they_describe() {
        let bytes = journal(&[
            Record::Append(vec![1, 2, 3]),
            Record::Append(vec![4]),
            Record::Reset(vec![1, 4]),
            Record::Append(vec![5, 6]),
        ]);
        let got = replay(&bytes).unwrap();
        assert_eq!(got.header, header());
        assert_eq!(got.history, vec![1, 4, 5, 6]);
        assert_eq!((got.good_len, got.torn_bytes), (bytes.len(), 0));
        let empty = replay(&journal(&[])).unwrap();
        assert!(empty.history.is_empty());
    }

    #[test]
    fn a_torn_last_record_is_dropped_and_everything_before_it_kept() {
        let whole = journal(&[Record::Append(vec![1, 2]), Record::Append(vec![3, 4, 5])]);
        let first_end = whole.len() - encode_record(&Record::Append(vec![3, 4, 5])).len();
        for cut in first_end + 1..whole.len() {
            let got = replay(&whole[..cut]).unwrap();
            assert_eq!(got.history, vec![1, 2], "cut at {cut}");
            assert_eq!(got.good_len, first_end);
            assert_eq!(got.torn_bytes, cut - first_end);
        }
        // A flipped bit in the last record is a torn write too.
        let mut flipped = whole.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(replay(&flipped).unwrap().history, vec![1, 2]);
    }

    /// Tails a crash or a power cut leaves, of every length up to a page:
    /// zeros (blocks allocated and never filled), garbage, and a record
    /// cut short. Each is dropped and the history before it kept.
    #[test]
    fn any_tail_with_no_good_record_in_it_is_torn_and_dropped() {
        use rand::{Rng, SeedableRng};
        let whole = journal(&[Record::Append(vec![1, 2]), Record::Append(vec![3, 4, 5])]);
        let next = encode_record(&Record::Append((0..2000).collect()));
        let mut rng = rand::rngs::StdRng::seed_from_u64(28);
        for n in 1..=4096 {
            let random: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            let tails = [vec![0u8; n], random, next[..n.min(next.len() - 1)].to_vec()];
            for (kind, tail) in ["zeros", "random", "a cut record"].iter().zip(tails) {
                let mut bytes = whole.clone();
                bytes.extend_from_slice(&tail);
                let got = replay(&bytes).unwrap_or_else(|e| panic!("{kind} x{n}: {e}"));
                assert_eq!(got.history, vec![1, 2, 3, 4, 5], "{kind} x{n}");
                assert_eq!((got.good_len, got.torn_bytes), (whole.len(), tail.len()));
            }
        }
        // The last record zeroed in place, and a torn write padded with
        // zeros to the end of its 4 KiB block.
        let last = encode_record(&Record::Append(vec![3, 4, 5])).len();
        let mut zeroed = whole.clone();
        let end = zeroed.len();
        zeroed[end - last..].fill(0);
        assert_eq!(replay(&zeroed).unwrap().history, vec![1, 2]);
        let mut padded = whole.clone();
        padded.extend_from_slice(&next[..100]);
        padded.resize(4096, 0);
        let got = replay(&padded).unwrap();
        assert_eq!((got.history.len(), got.good_len), (5, whole.len()));
    }

    #[test]
    fn a_bad_record_with_a_good_one_anywhere_after_it_is_damage() {
        let first = journal(&[Record::Append(vec![1, 2])]);
        let good = encode_record(&Record::Append(vec![9]));
        for gap in [0usize, 1, 12, 13, 100, 4000] {
            let mut bytes = first.clone();
            bytes.extend(std::iter::repeat_n(0u8, gap.max(1)));
            bytes.extend(&good);
            bytes.extend([0u8; 7]);
            assert_eq!(
                replay(&bytes),
                Err(JournalError::DamagedRecord {
                    offset: first.len()
                }),
                "gap {gap}"
            );
        }
    }

    #[test]
    fn damage_before_the_last_record_refuses_the_whole_journal() {
        let whole = journal(&[Record::Append(vec![1, 2]), Record::Append(vec![3])]);
        let header_len = encode_header(&header()).len();
        for at in header_len..header_len + encode_record(&Record::Append(vec![1, 2])).len() {
            let mut bad = whole.clone();
            bad[at] ^= 0x10;
            assert_eq!(
                replay(&bad),
                Err(JournalError::DamagedRecord { offset: header_len }),
                "flip at {at}"
            );
        }
    }

    fn hints(first_block: u32, blocks: usize, page: u32) -> Record {
        Record::Pages(PageHints {
            first_block,
            n_layers: 2,
            blocks: (0..blocks as u32)
                .map(|b| {
                    [page + 2 * b, PageHint::ABSENT]
                        .map(|page| PageHint {
                            page,
                            checksum: u64::from(page) << 40 | 0xabcd,
                        })
                        .into()
                })
                .collect(),
        })
    }

    #[test]
    fn page_hints_replace_from_their_first_block_and_a_gap_is_not_kept() {
        let row = |page| -> Box<[PageHint]> {
            [page, PageHint::ABSENT]
                .map(|page| PageHint {
                    page,
                    checksum: u64::from(page) << 40 | 0xabcd,
                })
                .into()
        };
        let bytes = journal(&[
            Record::Append((0..64).collect()),
            hints(0, 3, 10),
            // Blocks 2 and 3 from elsewhere: block 2 is replaced.
            hints(2, 2, 50),
            // A run starting past the end leaves a gap: dropped.
            hints(9, 1, 90),
        ]);
        let got = replay(&bytes).unwrap();
        assert_eq!(got.history.len(), 64);
        assert_eq!(got.hints, vec![row(10), row(12), row(50), row(52)]);
        assert_eq!(got.digest, None);
        // A reset starts the hints over.
        let bytes = journal(&[hints(0, 2, 10), Record::Reset(vec![1]), hints(0, 1, 70)]);
        assert_eq!(replay(&bytes).unwrap().hints, vec![row(70)]);
    }

    #[test]
    fn a_digest_stands_until_the_history_changes() {
        let got = replay(&journal(&[Record::Append(vec![1]), Record::Digest(77)])).unwrap();
        assert_eq!(got.digest, Some(77));
        let got = replay(&journal(&[
            Record::Digest(77),
            Record::Append(vec![1]),
            hints(0, 1, 3),
        ]))
        .unwrap();
        assert_eq!(got.digest, None);
        let got = replay(&journal(&[Record::Digest(5), Record::Reset(vec![2])])).unwrap();
        assert_eq!(got.digest, None);
    }

    #[test]
    fn misshapen_page_hints_are_damage_like_any_bad_record() {
        let good = encode_record(&hints(0, 2, 10));
        // A layer count that does not match the payload, with a valid CRC.
        let mut bad = good.clone();
        bad[13 + 8..13 + 12].copy_from_slice(&3u32.to_le_bytes());
        let crc = crc32c::crc32c(&bad[12..]);
        bad[8..12].copy_from_slice(&crc.to_le_bytes());
        let mut bytes = journal(&[Record::Append(vec![1])]);
        bytes.extend(&bad);
        bytes.extend(encode_record(&Record::Append(vec![2])));
        assert!(matches!(
            replay(&bytes),
            Err(JournalError::DamagedRecord { .. })
        ));
        // Past the most blocks a history can have.
        let far = encode_record(&hints(MAX_HINTED_BLOCKS as u32, 1, 10));
        let mut bytes = journal(&[]);
        bytes.extend(&far);
        bytes.extend(encode_record(&Record::Append(vec![2])));
        assert!(matches!(
            replay(&bytes),
            Err(JournalError::DamagedRecord { .. })
        ));
    }

    #[test]
    fn a_damaged_or_foreign_header_is_refused() {
        let whole = journal(&[Record::Append(vec![1])]);
        for at in 0..encode_header(&header()).len() {
            let mut bad = whole.clone();
            bad[at] ^= 0x01;
            assert!(replay(&bad).is_err(), "flip at {at}");
        }
        let mut other = whole.clone();
        other[8..12].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(replay(&other), Err(JournalError::Version(3)));
        assert_eq!(replay(b"hello"), Err(JournalError::BadMagic));
        assert_eq!(replay(&whole[..20]), Err(JournalError::BadHeader));
    }
    #[test]
    fn the_owner_is_read_back_and_a_header_without_one_is_anyones() {
        let back = replay(&journal(&[Record::Append(vec![1, 2])])).unwrap();
        assert_eq!(back.header, header());
        let unowned = Header {
            owner: Tenant::NONE,
            ..header()
        };
        let back = replay(&encode_header(&unowned)).unwrap();
        assert_eq!(back.header.owner, Tenant::NONE);
        // A version 1 header: the same fields, no owner length.
        let mut v1 = encode_header(&unowned);
        v1.truncate(v1.len() - 8);
        v1[8..12].copy_from_slice(&VERSION_WITHOUT_OWNER.to_le_bytes());
        let crc = crc32c::crc32c(&v1);
        v1.extend_from_slice(&crc.to_le_bytes());
        v1.extend(encode_record(&Record::Append(vec![5])));
        let back = replay(&v1).unwrap();
        assert_eq!(back.header, unowned);
        assert_eq!(back.history, vec![5]);
        // An owner that is no tenant identity is a damaged header.
        let mut odd = encode_header(&header());
        let at = odd.len() - 4 - "alice".len();
        odd[at] = b' ';
        odd.truncate(odd.len() - 4);
        let crc = crc32c::crc32c(&odd);
        odd.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(replay(&odd), Err(JournalError::BadHeader));
    }
}
