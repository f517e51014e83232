//! Writing GGUF files: metadata and tensors laid out as the `gguf` Python package's
//! `GGUFWriter` lays them out (version 3, little-endian, keys and tensors in the order they were
//! added, every tensor's data padded to the alignment), so that the same contents give the same
//! bytes.

use crate::dequant::GgmlType;
use crate::error::{GgufError, Result};
use crate::file::{DEFAULT_ALIGNMENT, MAGIC};
use crate::value::Value;

/// A GGUF file under construction: add metadata and tensors, then take its bytes.
///
/// ```
/// use kd_gguf::{GgmlType, GgufFile, GgufWriter, Value};
///
/// # fn main() -> Result<(), kd_gguf::GgufError> {
/// let mut w = GgufWriter::new("llama");
/// w.add("llama.block_count", Value::U32(1))?;
/// let bias: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
/// w.add_tensor("output_norm.weight", GgmlType::F32, &[2], bias)?;
/// let bytes = w.to_bytes()?;
/// # let dir = tempfile::tempdir().unwrap();
/// # let path = dir.path().join("m.gguf");
/// # std::fs::write(&path, &bytes).unwrap();
/// let back = GgufFile::open(&path)?;
/// assert_eq!(back.uint("llama.block_count")?, 1);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    /// GGUF order: the fastest-varying dimension first.
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

impl GgufWriter {
    /// An empty file whose `general.architecture` is `architecture` (the first key, as the
    /// `gguf` package writes it).
    pub fn new(architecture: &str) -> Self {
        Self {
            metadata: vec![(
                "general.architecture".into(),
                Value::String(architecture.into()),
            )],
            tensors: Vec::new(),
        }
    }

    /// Adds a metadata key. A key given twice or an empty array (which GGUF readers cannot type)
    /// is an error naming the key; so is an array whose items are not all of one type.
    pub fn add(&mut self, key: &str, value: Value) -> Result<()> {
        if self.metadata.iter().any(|(k, _)| k == key) {
            return Err(unwritable(format!("metadata key `{key}`"), "added twice"));
        }
        check_value(&value).map_err(|m| unwritable(format!("metadata key `{key}`"), m))?;
        self.metadata.push((key.into(), value));
        Ok(())
    }

    /// Adds a tensor of type `ty` with row-major `shape` (PyTorch order: `[out, in]` for a
    /// projection) and its encoded `data`. The data must hold exactly the shape's elements in
    /// whole blocks of the type; a name given twice is an error.
    pub fn add_tensor(
        &mut self,
        name: &str,
        ty: GgmlType,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<()> {
        let what = || format!("tensor `{name}`");
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(unwritable(what(), "added twice"));
        }
        if !(1..=4).contains(&shape.len()) {
            return Err(unwritable(
                what(),
                format!("shape {shape:?}: GGUF holds 1 to 4 dimensions"),
            ));
        }
        let Some((block, bytes)) = ty.block() else {
            return Err(unwritable(
                what(),
                format!("type {} has no known layout", ty.name()),
            ));
        };
        let row = shape[shape.len() - 1];
        let n: usize = shape.iter().product();
        if !row.is_multiple_of(block) || data.len() != n / block * bytes {
            return Err(unwritable(
                what(),
                format!(
                    "{} bytes of {} for shape {shape:?} (rows of {row} in blocks of {block} \
                     elements take {} bytes)",
                    data.len(),
                    ty.name(),
                    n / block * bytes
                ),
            ));
        }
        self.tensors.push(PendingTensor {
            name: name.into(),
            dims: shape.iter().rev().map(|&d| d as u64).collect(),
            ty,
            data,
        });
        Ok(())
    }

    /// The file's bytes: header, metadata, tensor descriptions, then the data from the next
    /// multiple of the alignment (`general.alignment` when it was added, else 32).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let alignment = match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => match v {
                Value::U32(a) if a.is_power_of_two() => u64::from(*a),
                _ => {
                    return Err(unwritable(
                        "metadata key `general.alignment`".into(),
                        format!("{v:?}: expected a uint32 power of two"),
                    ));
                }
            },
        } as usize;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend_from_slice(&type_id(value).to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += t.data.len().next_multiple_of(alignment);
        }
        out.resize(out.len().next_multiple_of(alignment), 0);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(out.len().next_multiple_of(alignment), 0);
        }
        Ok(out)
    }
}

fn unwritable(what: String, message: impl Into<String>) -> GgufError {
    GgufError::Unwritable {
        what,
        message: message.into(),
    }
}

/// GGUF's `gguf_type` id of a value.
fn type_id(value: &Value) -> u32 {
    match value {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

/// Arrays are non-empty, of one item type, and not nested deeper than GGUF readers accept.
fn check_value(value: &Value) -> std::result::Result<(), String> {
    let Value::Array(items) = value else {
        return Ok(());
    };
    let Some(first) = items.first() else {
        return Err("an empty array (its item type cannot be written)".into());
    };
    let ty = type_id(first);
    if let Some(other) = items.iter().find(|v| type_id(v) != ty) {
        return Err(format!(
            "an array of mixed item types ({} and {})",
            first.type_name(),
            other.type_name()
        ));
    }
    if matches!(first, Value::Array(_)) {
        return Err("an array of arrays".into());
    }
    Ok(())
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(items) => {
            // `check_value` ran when the key was added: non-empty, one item type.
            out.extend_from_slice(&type_id(&items[0]).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}
