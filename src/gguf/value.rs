//! Metadata values: the thirteen GGUF value types, arrays included.

use super::cursor::{vec_for_claimed, Cursor};
use super::GgufError;

/// Deepest array nesting accepted (real files use one level).
pub const MAX_ARRAY_DEPTH: usize = 4;

/// Longest metadata array accepted. The largest real ones are vocabularies
/// and merge lists of a few hundred thousand entries.
pub const MAX_ARRAY_LEN: u64 = 1 << 28;

/// The type tag of a metadata value, numbered as in the GGUF specification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl MetaValueType {
    /// Maps a GGUF value type id to a type, or `None` for ids outside the
    /// specification.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::U8,
            1 => Self::I8,
            2 => Self::U16,
            3 => Self::I16,
            4 => Self::U32,
            5 => Self::I32,
            6 => Self::F32,
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10 => Self::U64,
            11 => Self::I64,
            12 => Self::F64,
            _ => return None,
        })
    }

    /// The type id written in the file.
    pub fn id(self) -> u32 {
        match self {
            Self::U8 => 0,
            Self::I8 => 1,
            Self::U16 => 2,
            Self::I16 => 3,
            Self::U32 => 4,
            Self::I32 => 5,
            Self::F32 => 6,
            Self::Bool => 7,
            Self::String => 8,
            Self::Array => 9,
            Self::U64 => 10,
            Self::I64 => 11,
            Self::F64 => 12,
        }
    }

    /// A short lower-case name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::U8 => "u8",
            Self::I8 => "i8",
            Self::U16 => "u16",
            Self::I16 => "i16",
            Self::U32 => "u32",
            Self::I32 => "i32",
            Self::F32 => "f32",
            Self::Bool => "bool",
            Self::String => "string",
            Self::Array => "array",
            Self::U64 => "u64",
            Self::I64 => "i64",
            Self::F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type occupies in the file.
    fn min_bytes(self) -> usize {
        match self {
            Self::U8 | Self::I8 | Self::Bool => 1,
            Self::U16 | Self::I16 => 2,
            Self::U32 | Self::I32 | Self::F32 => 4,
            Self::U64 | Self::I64 | Self::F64 | Self::String => 8,
            Self::Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(MetaArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A homogeneous metadata array.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<MetaArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl MetaValue {
    /// The type tag this value is written with.
    pub fn value_type(&self) -> MetaValueType {
        match self {
            Self::U8(_) => MetaValueType::U8,
            Self::I8(_) => MetaValueType::I8,
            Self::U16(_) => MetaValueType::U16,
            Self::I16(_) => MetaValueType::I16,
            Self::U32(_) => MetaValueType::U32,
            Self::I32(_) => MetaValueType::I32,
            Self::F32(_) => MetaValueType::F32,
            Self::Bool(_) => MetaValueType::Bool,
            Self::String(_) => MetaValueType::String,
            Self::Array(_) => MetaValueType::Array,
            Self::U64(_) => MetaValueType::U64,
            Self::I64(_) => MetaValueType::I64,
            Self::F64(_) => MetaValueType::F64,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of
    /// any width (files disagree on which width they use for counts).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is a float.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => None,
        }
    }
}

impl MetaArray {
    /// The type of the array's elements.
    pub fn element_type(&self) -> MetaValueType {
        match self {
            Self::U8(_) => MetaValueType::U8,
            Self::I8(_) => MetaValueType::I8,
            Self::U16(_) => MetaValueType::U16,
            Self::I16(_) => MetaValueType::I16,
            Self::U32(_) => MetaValueType::U32,
            Self::I32(_) => MetaValueType::I32,
            Self::F32(_) => MetaValueType::F32,
            Self::Bool(_) => MetaValueType::Bool,
            Self::String(_) => MetaValueType::String,
            Self::Array(_) => MetaValueType::Array,
            Self::U64(_) => MetaValueType::U64,
            Self::I64(_) => MetaValueType::I64,
            Self::F64(_) => MetaValueType::F64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::I8(v) => v.len(),
            Self::U16(v) => v.len(),
            Self::I16(v) => v.len(),
            Self::U32(v) => v.len(),
            Self::I32(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::Bool(v) => v.len(),
            Self::String(v) => v.len(),
            Self::Array(v) => v.len(),
            Self::U64(v) => v.len(),
            Self::I64(v) => v.len(),
            Self::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn read_type(cur: &mut Cursor<'_>, key: &str) -> Result<MetaValueType, GgufError> {
    let type_id = cur.u32("metadata value type")?;
    MetaValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.to_owned(),
        type_id,
    })
}

/// Reads a value whose type tag comes first.
pub(super) fn read_tagged(cur: &mut Cursor<'_>, key: &str) -> Result<MetaValue, GgufError> {
    let ty = read_type(cur, key)?;
    read_value(cur, key, ty, 0)
}

fn read_value(
    cur: &mut Cursor<'_>,
    key: &str,
    ty: MetaValueType,
    depth: usize,
) -> Result<MetaValue, GgufError> {
    const W: &str = "metadata value";
    Ok(match ty {
        MetaValueType::U8 => MetaValue::U8(cur.u8(W)?),
        MetaValueType::I8 => MetaValue::I8(cur.u8(W)? as i8),
        MetaValueType::U16 => MetaValue::U16(cur.u16(W)?),
        MetaValueType::I16 => MetaValue::I16(cur.u16(W)? as i16),
        MetaValueType::U32 => MetaValue::U32(cur.u32(W)?),
        MetaValueType::I32 => MetaValue::I32(cur.u32(W)? as i32),
        MetaValueType::F32 => MetaValue::F32(f32::from_bits(cur.u32(W)?)),
        MetaValueType::Bool => MetaValue::Bool(cur.u8(W)? != 0),
        MetaValueType::String => MetaValue::String(cur.string("metadata string")?),
        MetaValueType::U64 => MetaValue::U64(cur.u64(W)?),
        MetaValueType::I64 => MetaValue::I64(cur.u64(W)? as i64),
        MetaValueType::F64 => MetaValue::F64(f64::from_bits(cur.u64(W)?)),
        MetaValueType::Array => MetaValue::Array(read_array(cur, key, depth + 1)?),
    })
}

fn read_array(cur: &mut Cursor<'_>, key: &str, depth: usize) -> Result<MetaArray, GgufError> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            key: key.to_owned(),
            limit: MAX_ARRAY_DEPTH,
        });
    }
    let ty = read_type(cur, key)?;
    let n = cur.count("metadata array length", ty.min_bytes(), MAX_ARRAY_LEN)?;
    macro_rules! collect {
        ($variant:ident, $read:expr) => {{
            let mut v = vec_for_claimed(n);
            for _ in 0..n {
                v.push($read);
            }
            MetaArray::$variant(v)
        }};
    }
    const W: &str = "metadata array element";
    Ok(match ty {
        MetaValueType::U8 => MetaArray::U8(cur.take(n, W)?.to_vec()),
        MetaValueType::I8 => MetaArray::I8(cur.take(n, W)?.iter().map(|&b| b as i8).collect()),
        MetaValueType::U16 => collect!(U16, cur.u16(W)?),
        MetaValueType::I16 => collect!(I16, cur.u16(W)? as i16),
        MetaValueType::U32 => collect!(U32, cur.u32(W)?),
        MetaValueType::I32 => collect!(I32, cur.u32(W)? as i32),
        MetaValueType::F32 => collect!(F32, f32::from_bits(cur.u32(W)?)),
        MetaValueType::Bool => MetaArray::Bool(cur.take(n, W)?.iter().map(|&b| b != 0).collect()),
        MetaValueType::String => collect!(String, cur.string("metadata array string")?),
        MetaValueType::U64 => collect!(U64, cur.u64(W)?),
        MetaValueType::I64 => collect!(I64, cur.u64(W)? as i64),
        MetaValueType::F64 => collect!(F64, f64::from_bits(cur.u64(W)?)),
        MetaValueType::Array => collect!(Array, read_array(cur, key, depth + 1)?),
    })
}
