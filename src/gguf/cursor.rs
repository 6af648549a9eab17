//! A forward-only reader over the mapped bytes. Every read checks that the
//! bytes exist first and reports a `Truncated` error naming the field.

use super::GgufError;

/// Longest string accepted anywhere in the header (chat templates can be tens
/// of kilobytes; nothing legitimate comes near this).
pub const MAX_STRING_BYTES: u64 = 16 << 20;

/// Most items reserved up front for a list whose length the file claims.
/// Counts are already bounded by the bytes left, but a multi-gigabyte file
/// could still claim hundreds of millions of items (and nested arrays each
/// claim against the same remaining bytes); beyond this, vectors grow only
/// as items are really parsed.
const MAX_PREALLOC_ITEMS: usize = 1 << 16;

/// A vector with room for `claimed` items, reserving at most
/// [`MAX_PREALLOC_ITEMS`] so a claimed count never becomes an allocation
/// before the items themselves have been read.
pub fn vec_for_claimed<T>(claimed: usize) -> Vec<T> {
    Vec::with_capacity(claimed.min(MAX_PREALLOC_ITEMS))
}

pub struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len());
        match end {
            Some(end) => {
                let out = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(out)
            }
            None => Err(GgufError::Truncated {
                what,
                offset: self.pos as u64,
                needed: n as u64,
                file_len: self.bytes.len() as u64,
            }),
        }
    }

    pub fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let slice = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }
    pub fn u16(&mut self, what: &'static str) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count that must fit the remaining bytes when each item takes at least
    /// `min_item_bytes`, and must not exceed `cap`, so a hostile count cannot
    /// make us allocate or loop beyond what the file really holds.
    pub fn count(
        &mut self,
        what: &'static str,
        min_item_bytes: usize,
        cap: u64,
    ) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let fits = (self.remaining() / min_item_bytes.max(1)) as u64;
        let limit = fits.min(cap);
        if n > limit {
            return Err(GgufError::TooLarge {
                what,
                value: n,
                limit,
            });
        }
        Ok(n as usize)
    }

    /// A GGUF string: u64 length then that many UTF-8 bytes.
    pub fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > MAX_STRING_BYTES {
            return Err(GgufError::TooLarge {
                what,
                value: len,
                limit: MAX_STRING_BYTES,
            });
        }
        let offset = self.pos as u64;
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 { what, offset })
    }
}
