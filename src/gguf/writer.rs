//! Writing GGUF images: the inverse of the reader, used to build test files,
//! the fuzzing seed corpus and synthetic models.
//!
//! The writer is a faithful serializer: it writes the header, metadata and
//! tensor directory it is given, lays tensor data out at aligned offsets,
//! and checks nothing else. That is on purpose (tests write deliberately
//! inconsistent files); [`GgufFile::from_bytes`](super::GgufFile::from_bytes)
//! is the validator.
//!
//! Tensor data is either held here ([`GgufWriter::add_tensor`]) or made
//! while the file is written ([`GgufWriter::add_tensor_streamed`] and
//! [`GgufWriter::write_streaming`]), so a model of gigabytes goes to disk
//! tensor by tensor without ever being whole in memory.

use std::io::{self, Write};
use std::path::Path;

use super::value::{MetaArray, MetaValue};
use crate::quant::GgmlType;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const ALIGNMENT_KEY: &str = "general.alignment";

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: TensorData,
}

/// A tensor's bytes: held, or made by the caller of `write_streaming`.
enum TensorData {
    Held(Vec<u8>),
    Streamed(u64),
}

impl PendingTensor {
    fn byte_len(&self) -> u64 {
        match &self.data {
            TensorData::Held(bytes) => bytes.len() as u64,
            TensorData::Streamed(len) => *len,
        }
    }
}

/// Builds a GGUF image in memory.
///
/// ```
/// use inferd::gguf::{GgufFile, GgufWriter, MetaValue};
/// use inferd::quant::GgmlType;
///
/// let mut w = GgufWriter::new(3);
/// w.add_meta("general.architecture", MetaValue::String("llama".into()));
/// w.add_tensor("norm.weight", &[4], GgmlType::F32, vec![0u8; 16]);
/// let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
/// assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
/// assert_eq!(file.tensor("norm.weight").unwrap().byte_len, 16);
/// ```
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    /// An empty image of format `version`. Versions 2 and 3 share one
    /// little-endian layout; any other number is written as given, so tests
    /// can produce files the reader must refuse.
    pub fn new(version: u32) -> Self {
        Self {
            version,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Appends a metadata entry. Keys are written in the order added, and a
    /// repeated key is written twice.
    pub fn add_meta(&mut self, key: impl Into<String>, value: MetaValue) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Appends a tensor. `dims[0]` is the row length (ggml order); `bytes` is
    /// the tensor's data exactly as stored, and is not checked against the
    /// shape and type.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        bytes: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            data: TensorData::Held(bytes),
        });
        self
    }

    /// Appends a tensor of `byte_len` bytes that are not held here: the
    /// producer given to [`write_streaming`](Self::write_streaming) writes
    /// them. [`to_bytes`](Self::to_bytes) writes zeros in their place.
    pub fn add_tensor_streamed(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        byte_len: u64,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            data: TensorData::Streamed(byte_len),
        });
        self
    }

    /// Sets the data alignment (default 32). Unless a `general.alignment`
    /// entry was added by hand, one holding `n` is written when `n` is not
    /// the default. Padding uses `n` (0 is treated as 1), whatever the
    /// metadata says.
    pub fn alignment(&mut self, n: u64) -> &mut Self {
        self.alignment = n;
        self
    }

    /// The complete file image.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment.max(1);
        let data_len: u64 = self.tensors.iter().map(|t| t.byte_len() + align).sum();
        let mut out = self.head();
        out.reserve(data_len as usize);
        for t in &self.tensors {
            match &t.data {
                TensorData::Held(bytes) => out.extend_from_slice(bytes),
                TensorData::Streamed(len) => out.resize(out.len() + *len as usize, 0),
            }
            pad_to(&mut out, align);
        }
        out
    }

    /// Writes the image to `out` and returns its length: held tensors as
    /// they are, and each tensor added with
    /// [`add_tensor_streamed`](Self::add_tensor_streamed) by
    /// `produce(index, sink)`, where `index` counts every tensor in the
    /// order added. A producer that writes other than the declared number
    /// of bytes fails the write (`InvalidData`), so the directory's offsets
    /// always hold.
    pub fn write_streaming<W: Write>(
        &self,
        out: &mut W,
        mut produce: impl FnMut(usize, &mut dyn Write) -> io::Result<()>,
    ) -> io::Result<u64> {
        let align = self.alignment.max(1);
        let head = self.head();
        out.write_all(&head)?;
        let mut written = head.len() as u64;
        let zeros = [0u8; 64];
        for (index, t) in self.tensors.iter().enumerate() {
            match &t.data {
                TensorData::Held(bytes) => out.write_all(bytes)?,
                TensorData::Streamed(len) => {
                    let mut sink = Counted {
                        out: &mut *out,
                        n: 0,
                    };
                    produce(index, &mut sink)?;
                    if sink.n != *len {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "tensor {}: {} bytes produced, {len} declared",
                                t.name, sink.n
                            ),
                        ));
                    }
                }
            }
            written += t.byte_len();
            let mut pad = round_up(written, align) - written;
            while pad > 0 {
                let n = pad.min(zeros.len() as u64);
                out.write_all(&zeros[..n as usize])?;
                pad -= n;
            }
            written = round_up(written, align);
        }
        Ok(written)
    }

    /// Header, metadata and tensor directory, padded to the data's alignment
    /// when there are tensors.
    fn head(&self) -> Vec<u8> {
        let align = self.alignment.max(1);
        let auto_alignment = self.alignment != DEFAULT_ALIGNMENT
            && !self.metadata.iter().any(|(k, _)| k == ALIGNMENT_KEY);
        let mut out = Vec::with_capacity(4096);

        out.extend_from_slice(GGUF_MAGIC);
        put_u32(&mut out, self.version);
        put_u64(&mut out, self.tensors.len() as u64);
        put_u64(
            &mut out,
            (self.metadata.len() + usize::from(auto_alignment)) as u64,
        );

        if auto_alignment {
            put_string(&mut out, ALIGNMENT_KEY);
            // u32 is what llama.cpp writes and reads for this key.
            let value = u32::try_from(self.alignment)
                .map_or(MetaValue::U64(self.alignment), MetaValue::U32);
            put_tagged(&mut out, &value);
        }
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            put_tagged(&mut out, value);
        }

        let mut offset = 0u64;
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            put_u32(&mut out, t.dims.len() as u32);
            for &d in &t.dims {
                put_u64(&mut out, d);
            }
            put_u32(&mut out, t.ty.id());
            put_u64(&mut out, offset);
            offset = round_up(offset + t.byte_len(), align);
        }

        if !self.tensors.is_empty() {
            pad_to(&mut out, align);
        }
        out
    }

    /// Writes the image to a file at `path`.
    pub fn write_to(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

/// A writer that counts what passes through it.
struct Counted<'a, W: Write> {
    out: &'a mut W,
    n: u64,
}

impl<W: Write> Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.out.write(buf)?;
        self.n += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

fn round_up(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

fn pad_to(out: &mut Vec<u8>, align: u64) {
    let len = out.len() as u64;
    out.resize(round_up(len, align) as usize, 0);
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_tagged(out: &mut Vec<u8>, value: &MetaValue) {
    put_u32(out, value.value_type().id());
    put_value(out, value);
}

fn put_value(out: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => out.push(*v),
        MetaValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => out.push(u8::from(*v)),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::Array(a) => put_array(out, a),
        MetaValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// An array: element type, length, then the elements without tags. Each
/// element of an array of arrays carries its own type and length.
fn put_array(out: &mut Vec<u8>, array: &MetaArray) {
    put_u32(out, array.element_type().id());
    put_u64(out, array.len() as u64);
    fn each<T: Copy, const N: usize>(out: &mut Vec<u8>, items: &[T], le: fn(T) -> [u8; N]) {
        for &x in items {
            out.extend_from_slice(&le(x));
        }
    }
    match array {
        MetaArray::U8(v) => out.extend_from_slice(v),
        MetaArray::I8(v) => each(out, v, i8::to_le_bytes),
        MetaArray::U16(v) => each(out, v, u16::to_le_bytes),
        MetaArray::I16(v) => each(out, v, i16::to_le_bytes),
        MetaArray::U32(v) => each(out, v, u32::to_le_bytes),
        MetaArray::I32(v) => each(out, v, i32::to_le_bytes),
        MetaArray::F32(v) => each(out, v, f32::to_le_bytes),
        MetaArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        MetaArray::String(v) => v.iter().for_each(|s| put_string(out, s)),
        MetaArray::Array(v) => v.iter().for_each(|a| put_array(out, a)),
        MetaArray::U64(v) => each(out, v, u64::to_le_bytes),
        MetaArray::I64(v) => each(out, v, i64::to_le_bytes),
        MetaArray::F64(v) => each(out, v, f64::to_le_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    #[test]
    fn empty_image_is_header_only() {
        let bytes = GgufWriter::new(3).to_bytes();
        assert_eq!(bytes.len(), 24);
        assert_eq!(&bytes[..4], b"GGUF");
        let file = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(file.version(), 3);
        assert_eq!(file.tensors().len(), 0);
        assert_eq!(file.metadata().count(), 0);
    }

    #[test]
    fn tensors_land_on_aligned_offsets() {
        let mut w = GgufWriter::new(2);
        w.alignment(64)
            .add_tensor("a", &[3], GgmlType::F32, vec![1; 12])
            .add_tensor("b", &[2, 2], GgmlType::F16, vec![2; 8]);
        let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(file.version(), 2);
        assert_eq!(file.alignment(), 64);
        assert_eq!(file.get(ALIGNMENT_KEY), Some(&MetaValue::U32(64)));
        assert_eq!(file.data_start() % 64, 0);
        let a = file.tensor("a").unwrap();
        let b = file.tensor("b").unwrap();
        assert_eq!(a.file_offset, file.data_start());
        assert_eq!(b.file_offset, file.data_start() + 64);
        assert_eq!(file.tensor_bytes(a), &[1; 12]);
        assert_eq!(file.tensor_bytes(b), &[2; 8]);
        assert_eq!(file.file_len() % 64, 0);
    }

    #[test]
    fn streamed_tensors_land_where_held_ones_would() {
        let data: [Vec<u8>; 3] = [vec![1; 12], vec![2; 40], vec![3; 8]];
        let mut held = GgufWriter::new(3);
        let mut streamed = GgufWriter::new(3);
        held.add_meta("k", MetaValue::U32(1));
        streamed.add_meta("k", MetaValue::U32(1));
        for (i, bytes) in data.iter().enumerate() {
            let dims = [bytes.len() as u64 / 4];
            held.add_tensor(format!("t{i}"), &dims, GgmlType::F32, bytes.clone());
        }
        streamed.add_tensor("t0", &[3], GgmlType::F32, data[0].clone());
        streamed.add_tensor_streamed("t1", &[10], GgmlType::F32, 40);
        streamed.add_tensor_streamed("t2", &[2], GgmlType::F32, 8);
        let mut out = Vec::new();
        let mut asked = Vec::new();
        let n = streamed
            .write_streaming(&mut out, |i, sink| {
                asked.push(i);
                // In pieces, as a producer writing chunk by chunk does.
                for piece in data[i].chunks(5) {
                    sink.write_all(piece)?;
                }
                Ok(())
            })
            .unwrap();
        assert_eq!(asked, [1, 2]);
        assert_eq!(n, out.len() as u64);
        assert_eq!(out, held.to_bytes());
        // Without a producer the streamed tensors are zeros of their size.
        let zeros = GgufFile::from_bytes(streamed.to_bytes()).unwrap();
        assert_eq!(zeros.tensor_data("t1").unwrap(), &[0; 40]);
    }

    #[test]
    fn a_producer_that_writes_the_wrong_length_fails_the_write() {
        let mut w = GgufWriter::new(3);
        w.add_tensor_streamed("t", &[8], GgmlType::F32, 32);
        let err = w
            .write_streaming(&mut Vec::new(), |_, sink| sink.write_all(&[0; 31]))
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(
            err.to_string().contains("31 bytes produced, 32 declared"),
            "{err}"
        );
    }

    #[test]
    fn hand_written_alignment_key_is_kept_verbatim() {
        let mut w = GgufWriter::new(3);
        w.alignment(16).add_meta(ALIGNMENT_KEY, MetaValue::U64(16));
        let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(file.metadata().count(), 1);
        assert_eq!(file.get(ALIGNMENT_KEY), Some(&MetaValue::U64(16)));
    }
}
