//! The parsed file: header, metadata, tensor directory, and the mapped bytes
//! the tensor views borrow from.

use std::collections::HashMap;
use std::path::Path;

use memmap2::Mmap;

use super::cursor::{vec_for_claimed, Cursor};
use super::value::{read_tagged, MetaArray, MetaValue};
use super::GgufError;
use crate::quant::GgmlType;

/// Most dimensions a ggml tensor has.
pub const MAX_DIMS: usize = 4;
const GGUF_MAGIC: [u8; 4] = *b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_ALIGNMENT: u64 = 1 << 16;
/// Most tensors accepted (the largest real models have a few thousand).
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata entries accepted (real files have a few dozen).
pub const MAX_METADATA_ENTRIES: u64 = 1 << 20;
/// Smallest possible metadata entry: empty key (8) + type (4) + one byte.
const MIN_KV_BYTES: usize = 13;
/// Smallest possible tensor entry: empty name (8) + n_dims (4) + one dim (8)
/// + type (4) + offset (8).
const MIN_TENSOR_INFO_BYTES: usize = 32;

/// Where a tensor lives and what it holds. `dims[0]` is the innermost
/// (contiguous) dimension, as in ggml: a matrix of `dims[1]` rows of
/// `dims[0]` elements.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the first byte from the start of the file.
    pub file_offset: usize,
    /// Bytes the tensor occupies.
    pub byte_len: usize,
}

impl TensorInfo {
    /// Number of elements. (Every entry read from a file was checked not to
    /// overflow; for a hand-built entry that would, this saturates.)
    pub fn element_count(&self) -> u64 {
        saturating_product(&self.dims)
    }

    /// Elements in one row (the innermost dimension; 0 for a hand-built
    /// entry without dimensions).
    pub fn row_len(&self) -> usize {
        self.dims
            .first()
            .map_or(0, |&d| usize::try_from(d).unwrap_or(usize::MAX))
    }

    /// Rows: the product of every dimension but the innermost.
    pub fn row_count(&self) -> usize {
        let rows = saturating_product(self.dims.get(1..).unwrap_or(&[]));
        usize::try_from(rows).unwrap_or(usize::MAX)
    }
}

enum Backing {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An opened GGUF file. Tensor bytes are views into the memory map: nothing
/// is copied, so resident memory is the page cache's, shared across processes.
pub struct GgufFile {
    backing: Backing,
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.backing.bytes().len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        // SAFETY: the map is read-only and private to this process's view;
        // inferd never writes model files. A file truncated by another process
        // while mapped would fault, as with any mmap reader; model files are
        // treated as immutable while served.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        Self::parse(Backing::Map(map))
    }

    /// Parses a GGUF image held in memory (tests and fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Backing::Owned(bytes))
    }

    fn parse(backing: Backing) -> Result<Self, GgufError> {
        let bytes = backing.bytes();
        let mut cur = Cursor::new(bytes);
        let (version, tensor_count, kv_count) = read_header(&mut cur)?;
        let (metadata, metadata_index) = read_metadata(&mut cur, kv_count)?;
        let alignment = alignment_of(&metadata, &metadata_index)?;
        let (raw, tensor_index) = read_tensor_directory(&mut cur, tensor_count, alignment)?;
        let (data_start, data_len) =
            data_section(cur.position(), alignment, bytes.len(), tensor_count)?;
        check_tensor_extents(&raw, data_len)?;

        let tensors = raw
            .into_iter()
            .map(|t| TensorInfo {
                name: t.name,
                dims: t.dims,
                ty: t.ty,
                // In range: checked against the file length above.
                file_offset: (data_start + t.offset) as usize,
                byte_len: t.byte_len as usize,
            })
            .collect();

        Ok(Self {
            version,
            alignment,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            data_start: data_start as usize,
            backing,
        })
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Offset of the tensor data section from the start of the file.
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> usize {
        self.backing.bytes().len()
    }

    /// Every metadata entry, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &MetaValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// One metadata value by key.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_owned(),
        })
    }

    fn wrong_type(&self, key: &str, v: &MetaValue, expected: &'static str) -> GgufError {
        GgufError::WrongType {
            key: key.to_owned(),
            found: v.value_type().name(),
            expected,
        }
    }

    /// A required non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong_type(key, v, "unsigned integer"))
    }

    /// An optional non-negative integer (absent is `None`; present but of the
    /// wrong type is an error, never silently ignored).
    pub fn get_u64_opt(&self, key: &str) -> Result<Option<u64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.get_u64(key).map(Some),
        }
    }

    /// A required float (f32 or f64).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.wrong_type(key, v, "float"))
    }

    /// An optional float.
    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.get_f32(key).map(Some),
        }
    }

    /// An optional bool.
    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.wrong_type(key, v, "bool")),
        }
    }

    /// An optional array of bools; `None` when absent or when the key holds
    /// a single value instead (callers read that form separately), an
    /// error for an array of anything else.
    pub fn get_bool_array_opt(&self, key: &str) -> Result<Option<Vec<bool>>, GgufError> {
        match self.get(key) {
            Some(MetaValue::Array(MetaArray::Bool(flags))) => Ok(Some(flags.clone())),
            Some(v @ MetaValue::Array(_)) => Err(self.wrong_type(key, v, "array of bool")),
            _ => Ok(None),
        }
    }

    /// A required string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            MetaValue::String(s) => Ok(s),
            v => Err(self.wrong_type(key, v, "string")),
        }
    }

    /// An optional string.
    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(_) => self.get_str(key).map(Some),
        }
    }

    /// A required array.
    pub fn get_array(&self, key: &str) -> Result<&MetaArray, GgufError> {
        match self.require(key)? {
            MetaValue::Array(a) => Ok(a),
            v => Err(self.wrong_type(key, v, "array")),
        }
    }

    /// Every tensor, in directory order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor's directory entry by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's directory entry, or a `MissingTensor` error.
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor {
            name: name.to_owned(),
        })
    }

    /// The bytes of a tensor of this file (a view into the map).
    ///
    /// # Panics
    /// Only if `info` did not come from this file: every entry of this file
    /// was checked to lie inside it when the file was opened.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.backing.bytes()[info.file_offset..info.file_offset + info.byte_len]
    }

    /// The bytes of the named tensor, or a `MissingTensor` error.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let info = self.require_tensor(name)?;
        Ok(self.tensor_bytes(info))
    }
}

fn saturating_product(dims: &[u64]) -> u64 {
    dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
}

/// The header: magic, version (2 or 3), and the tensor and metadata entry
/// counts, each bounded by what the rest of the file could hold.
fn read_header(cur: &mut Cursor<'_>) -> Result<(u32, usize, usize), GgufError> {
    let magic: [u8; 4] = cur.array("magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = cur.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let tensor_count = cur.count("tensor count", MIN_TENSOR_INFO_BYTES, MAX_TENSORS)?;
    let kv_count = cur.count("metadata entry count", MIN_KV_BYTES, MAX_METADATA_ENTRIES)?;
    Ok((version, tensor_count, kv_count))
}

/// Metadata entries in file order, and each key's index (a key twice is
/// an error).
type Metadata = (Vec<(String, MetaValue)>, HashMap<String, usize>);

/// Reads `kv_count` metadata entries.
fn read_metadata(cur: &mut Cursor<'_>, kv_count: usize) -> Result<Metadata, GgufError> {
    let mut metadata = vec_for_claimed(kv_count);
    let mut metadata_index = HashMap::with_capacity(kv_count.min(1024));
    for _ in 0..kv_count {
        let key = cur.string("metadata key")?;
        let value = read_tagged(cur, &key)?;
        if metadata_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey { key });
        }
        metadata.push((key, value));
    }
    Ok((metadata, metadata_index))
}

/// `general.alignment` (a power of two up to [`MAX_ALIGNMENT`]), or the
/// default when absent.
fn alignment_of(
    metadata: &[(String, MetaValue)],
    metadata_index: &HashMap<String, usize>,
) -> Result<u64, GgufError> {
    match metadata_index.get("general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(&i) => {
            let value: &MetaValue = &metadata[i].1;
            let a = value.as_u64().ok_or_else(|| GgufError::WrongType {
                key: "general.alignment".to_owned(),
                found: value.value_type().name(),
                expected: "unsigned integer",
            })?;
            if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT {
                return Err(GgufError::BadAlignment { alignment: a });
            }
            Ok(a)
        }
    }
}

/// A tensor directory entry as read, its offset relative to the data
/// section and not yet checked against the file's length.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    offset: u64,
    byte_len: u64,
}

/// Reads `tensor_count` directory entries (a name twice is an error), and
/// each name's index.
fn read_tensor_directory(
    cur: &mut Cursor<'_>,
    tensor_count: usize,
    alignment: u64,
) -> Result<(Vec<RawTensor>, HashMap<String, usize>), GgufError> {
    let mut raw: Vec<RawTensor> = vec_for_claimed(tensor_count);
    let mut tensor_index = HashMap::with_capacity(tensor_count.min(1024));
    for _ in 0..tensor_count {
        let t = read_tensor_info(cur, alignment)?;
        if tensor_index.insert(t.name.clone(), raw.len()).is_some() {
            return Err(GgufError::DuplicateTensor { name: t.name });
        }
        raw.push(t);
    }
    Ok((raw, tensor_index))
}

/// One directory entry: name, shape (1 to 4 dimensions, a size that does
/// not overflow), a known type, and an offset on the alignment.
fn read_tensor_info(cur: &mut Cursor<'_>, alignment: u64) -> Result<RawTensor, GgufError> {
    let name = cur.string("tensor name")?;
    let n_dims = cur.u32("tensor dimension count")?;
    if n_dims == 0 || n_dims as usize > MAX_DIMS {
        return Err(GgufError::BadShape {
            name,
            dims: vec![],
            why: "the number of dimensions must be 1 to 4",
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(cur.u64("tensor dimension")?);
    }
    let type_id = cur.u32("tensor type")?;
    let offset = cur.u64("tensor offset")?;
    let Some(ty) = GgmlType::from_id(type_id) else {
        return Err(GgufError::UnknownTensorType { name, type_id });
    };
    let byte_len = tensor_byte_len(&name, &dims, ty)?;
    if offset % alignment != 0 {
        return Err(GgufError::MisalignedTensor {
            name,
            offset,
            alignment,
        });
    }
    Ok(RawTensor {
        name,
        dims,
        ty,
        offset,
        byte_len,
    })
}

/// Where tensor data begins (the next aligned offset after the directory,
/// which ends at `dir_end`) and how many bytes of the file follow it.
fn data_section(
    dir_end: usize,
    alignment: u64,
    file_len: usize,
    tensor_count: usize,
) -> Result<(u64, u64), GgufError> {
    let dir_end = dir_end as u64;
    let data_start = dir_end.div_ceil(alignment) * alignment;
    let file_len = file_len as u64;
    let data_len = file_len.saturating_sub(data_start);
    if tensor_count > 0 && data_start > file_len {
        return Err(GgufError::Truncated {
            what: "tensor data padding",
            offset: dir_end,
            needed: data_start - dir_end,
            file_len,
        });
    }
    Ok((data_start, data_len))
}

/// Every tensor lies inside the `data_len` bytes of the data section and
/// none overlaps another (checked in offset order).
fn check_tensor_extents(raw: &[RawTensor], data_len: u64) -> Result<(), GgufError> {
    let mut by_offset: Vec<usize> = (0..raw.len()).collect();
    by_offset.sort_by_key(|&i| (raw[i].offset, raw[i].byte_len));
    for (k, &i) in by_offset.iter().enumerate() {
        let t = &raw[i];
        let end = t.offset.checked_add(t.byte_len).filter(|&e| e <= data_len);
        let Some(end) = end else {
            return Err(GgufError::TensorOutOfFile {
                name: t.name.clone(),
                start: t.offset,
                end: t.offset.saturating_add(t.byte_len),
                data_len,
            });
        };
        if let Some(&next) = by_offset.get(k + 1) {
            if raw[next].offset < end {
                return Err(GgufError::OverlappingTensors {
                    first: t.name.clone(),
                    second: raw[next].name.clone(),
                });
            }
        }
    }
    Ok(())
}

fn tensor_byte_len(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
    let bad = |why| GgufError::BadShape {
        name: name.to_owned(),
        dims: dims.to_vec(),
        why,
    };
    if dims.contains(&0) {
        return Err(bad("a dimension is zero"));
    }
    let elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= isize::MAX as u64)
        .ok_or_else(|| bad("the element count overflows"))?;
    let block = ty.block_len() as u64;
    if dims.first().is_some_and(|&row| row % block != 0) {
        return Err(bad("the row length is not a whole number of blocks"));
    }
    (elements / block)
        .checked_mul(ty.block_bytes() as u64)
        .ok_or_else(|| bad("the byte size overflows"))
}
