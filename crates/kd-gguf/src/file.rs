//! The file: header, metadata, tensor descriptions and the memory-mapped data, every length
//! and offset checked against the file's size before it is used.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use memmap2::Mmap;

use crate::dequant::{DequantError, GgmlType, dequantize};
use crate::error::{GgufError, Result};
use crate::value::Value;

/// One tensor's description.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Its name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions as GGUF stores them: the fastest-varying (a row's length) first.
    pub dims: Vec<u64>,
    /// Its type.
    pub ty: GgmlType,
    /// Offset of its data from the start of the data section.
    pub offset: u64,
    /// Size of its data in bytes (0 for a type this crate cannot read).
    pub size: u64,
}

impl TensorInfo {
    /// The shape in row-major order, as PyTorch would hold it (`dims` reversed):
    /// `[out, in]` for a projection, `[vocab, hidden]` for the embedding.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An open GGUF file: its metadata and tensor descriptions, with the tensor data memory-mapped.
pub struct GgufFile {
    path: PathBuf,
    /// Shared with the [`SharedBytes`] handed out, which keep it mapped.
    map: Arc<Mmap>,
    version: u32,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    index: BTreeMap<String, usize>,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

pub(crate) const MAGIC: &[u8; 4] = b"GGUF";
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest array nesting accepted (GGUF writers produce 1; the bound keeps a crafted file from
/// exhausting the stack).
const MAX_ARRAY_DEPTH: usize = 4;

/// A bounds-checked little-endian reader over the mapped file.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let len = self.bytes.len() as u64;
        let end = (self.pos as u64).checked_add(n).filter(|&e| e <= len);
        match end {
            Some(end) => {
                let out = &self.bytes[self.pos..end as usize];
                self.pos = end as usize;
                Ok(out)
            }
            None => Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                what: what(),
                offset: self.pos as u64,
                needed: n,
                len,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let b = self.take(N as u64, what)?;
        Ok(b.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_string()),
            Err(e) => Err(GgufError::Invalid {
                path: self.path.to_path_buf(),
                what: what(),
                message: format!("string is not valid UTF-8 ({e})"),
            }),
        }
    }

    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(what)?[0]),
            1 => Value::I8(self.array::<1>(what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            4 => Value::U32(self.u32(what)?),
            5 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.invalid(what, format!("bool byte is {b}, not 0 or 1"))),
            },
            8 => Value::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.invalid(what, "arrays nested too deeply".into()));
                }
                let elem = self.u32(what)?;
                let n = self.u64(what)?;
                // Every element takes at least one byte: a count beyond the bytes left is a
                // corrupt or truncated file, caught before allocating for it.
                let min = min_size(elem).ok_or_else(|| {
                    self.invalid(what, format!("unknown array element type {elem}"))
                })?;
                if n.checked_mul(min).is_none_or(|b| b > self.remaining()) {
                    return Err(GgufError::Truncated {
                        path: self.path.to_path_buf(),
                        what: format!("{} ({n} array elements)", what()),
                        offset: self.pos as u64,
                        needed: n.saturating_mul(min),
                        len: self.bytes.len() as u64,
                    });
                }
                let mut out = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    out.push(self.value(elem, depth + 1, what)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64(what)?),
            11 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(self.invalid(what, format!("unknown value type {other}"))),
        })
    }

    fn invalid(&self, what: &dyn Fn() -> String, message: String) -> GgufError {
        GgufError::Invalid {
            path: self.path.to_path_buf(),
            what: what(),
            message,
        }
    }
}

/// Smallest encoded size of a value of type `ty` (strings and arrays: their 8-byte length).
fn min_size(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// Tensor description `i`: name, dimensions, type and data offset, checked against the
/// alignment, with its size in bytes.
fn tensor_info(c: &mut Cursor<'_>, i: u64, alignment: u64) -> Result<TensorInfo> {
    let name = c.string(&|| format!("tensor description {i}'s name"))?;
    let what = || format!("tensor `{name}`");
    let n_dims = c.u32(&what)?;
    if !(1..=4).contains(&n_dims) {
        return Err(c.invalid(&what, format!("{n_dims} dimensions (1 to 4 expected)")));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64(&what)?);
    }
    let ty = GgmlType::from_id(c.u32(&what)?);
    let offset = c.u64(&what)?;
    if !offset.is_multiple_of(alignment) {
        return Err(c.invalid(
            &what,
            format!("data offset {offset} is not a multiple of the alignment {alignment}"),
        ));
    }
    let n = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| c.invalid(&what, format!("dimensions {dims:?} overflow")))?;
    let size = match ty.block() {
        None => 0,
        Some((block, bytes)) => {
            if !dims[0].is_multiple_of(block as u64) {
                return Err(c.invalid(
                    &what,
                    format!(
                        "rows of {} elements are not whole {}-element blocks of {}",
                        dims[0],
                        block,
                        ty.name()
                    ),
                ));
            }
            (n / block as u64)
                .checked_mul(bytes as u64)
                .ok_or_else(|| c.invalid(&what, "size overflows".into()))?
        }
    };
    Ok(TensorInfo {
        name,
        dims,
        ty,
        offset,
        size,
    })
}

impl GgufFile {
    /// Opens and parses a GGUF file; the tensor data stays mapped, not read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only; like every mmap-based model loader we rely on the file
        // not being truncated or rewritten while it is open (a truncation would fault, not
        // corrupt memory safety of safe code that holds no references across the change).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, map)
    }

    fn parse(path: PathBuf, map: Mmap) -> Result<Self> {
        let mut c = Cursor {
            bytes: &map,
            pos: 0,
            path: &path,
        };
        let header = || "the header".to_string();
        let magic: [u8; 4] = c.array(&header)?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic {
                path: path.clone(),
                found: magic,
            });
        }
        let version = c.u32(&header)?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion {
                path: path.clone(),
                version,
            });
        }
        let n_tensors = c.u64(&header)?;
        let n_kv = c.u64(&header)?;
        // A key/value pair takes at least 8 + 4 + 1 bytes, a tensor description 8 + 4 + 4 + 8.
        for (n, min, what) in [(n_kv, 13, "metadata entries"), (n_tensors, 24, "tensors")] {
            if n.checked_mul(min).is_none_or(|b| b > c.remaining()) {
                return Err(GgufError::Invalid {
                    path: path.clone(),
                    what: "the header".into(),
                    message: format!(
                        "it declares {n} {what}, more than the file's {} bytes can hold",
                        map.len()
                    ),
                });
            }
        }

        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata entry {i}'s key"))?;
            let what = || format!("metadata key `{key}`");
            let ty = c.u32(&what)?;
            let value = c.value(ty, 0, &what)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(c.invalid(&what, "the key appears twice".into()));
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::Invalid {
                        path: path.clone(),
                        what: "metadata key `general.alignment`".into(),
                        message: format!("{v:?} is not a positive power of two"),
                    });
                }
            },
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut index = BTreeMap::new();
        for i in 0..n_tensors {
            let info = tensor_info(&mut c, i, alignment)?;
            let what = || format!("tensor `{}`", info.name);
            if index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(c.invalid(&what, "the name appears twice".into()));
            }
            tensors.push(info);
        }

        let data_start = (c.pos as u64).next_multiple_of(alignment);
        let len = map.len() as u64;
        for t in &tensors {
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.size));
            if end.is_none_or(|e| e > len) {
                return Err(GgufError::Truncated {
                    path: path.clone(),
                    what: format!("tensor `{}` ({}, dims {:?})", t.name, t.ty.name(), t.dims),
                    offset: data_start.saturating_add(t.offset),
                    needed: t.size,
                    len,
                });
            }
        }
        tracing::debug!(
            path = %path.display(),
            version,
            keys = metadata.len(),
            tensors = tensors.len(),
            "opened GGUF file"
        );
        Ok(Self {
            path,
            map: Arc::new(map),
            version,
            metadata,
            tensors,
            index,
            data_start,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Every metadata key and value.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.into(),
        })
    }

    fn key_type(&self, key: &str, expected: &'static str, found: &Value) -> GgufError {
        GgufError::KeyType {
            path: self.path.clone(),
            key: key.into(),
            expected,
            found: found.type_name(),
        }
    }

    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.key_type(key, "a string", v))
    }

    /// A required non-negative integer.
    pub fn uint(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.key_type(key, "a non-negative integer", v))
    }

    /// An optional non-negative integer (`None` when absent, an error when of another type).
    pub fn opt_uint(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.key_type(key, "a non-negative integer", v))
            })
            .transpose()
    }

    /// An optional number.
    pub fn opt_float(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.key_type(key, "a number", v)))
            .transpose()
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.key_type(key, "a bool", v)))
            .transpose()
    }

    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.key_type(key, "a string", v)))
            .transpose()
    }

    /// A required array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        let a = v
            .as_array()
            .ok_or_else(|| self.key_type(key, "an array of strings", v))?;
        a.iter()
            .map(|e| {
                e.as_str()
                    .ok_or_else(|| self.key_type(key, "an array of strings", v))
            })
            .collect()
    }

    /// An optional array of integers.
    pub fn opt_ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let a = v
            .as_array()
            .ok_or_else(|| self.key_type(key, "an array of integers", v))?;
        a.iter()
            .map(|e| {
                e.as_i64()
                    .ok_or_else(|| self.key_type(key, "an array of integers", v))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// Every tensor description, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The description of a tensor.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    fn require_tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor {
            path: self.path.clone(),
            name: name.into(),
        })
    }

    /// The raw bytes of a tensor's data (checked against the file's size when it was opened).
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        Ok(&self.map[self.tensor_range(name)?])
    }

    /// [`tensor_bytes`](Self::tensor_bytes) without a copy, held beyond this handle: the
    /// bytes keep the file mapped (read-only; like every memory-mapped model loader, this
    /// relies on the file not being truncated or rewritten while they live). The pages are
    /// the file's, shared with the page cache, not the process's own memory.
    pub fn shared_tensor_bytes(&self, name: &str) -> Result<SharedBytes> {
        let range = self.tensor_range(name)?;
        Ok(SharedBytes(Shared::Mapped(Arc::clone(&self.map), range)))
    }

    /// Where a tensor of a supported type lies in the map.
    fn tensor_range(&self, name: &str) -> Result<std::ops::Range<usize>> {
        let t = self.require_tensor(name)?;
        if t.ty.block().is_none() {
            return Err(self.unsupported(t));
        }
        let start = (self.data_start + t.offset) as usize;
        Ok(start..start + t.size as usize)
    }

    fn unsupported(&self, t: &TensorInfo) -> GgufError {
        GgufError::UnsupportedType {
            path: self.path.clone(),
            tensor: t.name.clone(),
            ty: t.ty.name(),
        }
    }

    /// A tensor's values as f32, row-major in [`TensorInfo::shape`] order.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.require_tensor(name)?;
        let bytes = self.tensor_bytes(name)?;
        let n = usize::try_from(t.n_elements()).map_err(|_| GgufError::Invalid {
            path: self.path.clone(),
            what: format!("tensor `{name}`"),
            message: "too many elements for this platform".into(),
        })?;
        let mut out = vec![0f32; n];
        dequantize(t.ty, bytes, &mut out).map_err(|e| match e {
            DequantError::Unsupported(_) => self.unsupported(t),
            DequantError::Length { .. } => GgufError::Invalid {
                path: self.path.clone(),
                what: format!("tensor `{name}`"),
                message: e.to_string(),
            },
        })?;
        Ok(out)
    }
}

/// Bytes held by reference count: a range of a mapped GGUF file
/// ([`GgufFile::shared_tensor_bytes`]), or bytes of their own. Cheap to clone.
#[derive(Clone)]
pub struct SharedBytes(Shared);

#[derive(Clone)]
enum Shared {
    Mapped(Arc<Mmap>, std::ops::Range<usize>),
    Owned(Arc<[u8]>),
}

impl std::ops::Deref for SharedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Shared::Mapped(map, range) => &map[range.clone()],
            Shared::Owned(bytes) => bytes,
        }
    }
}

impl From<Vec<u8>> for SharedBytes {
    fn from(bytes: Vec<u8>) -> Self {
        Self(Shared::Owned(bytes.into()))
    }
}

impl SharedBytes {
    /// Whether the bytes are a mapped file's (not the process's own memory).
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Shared::Mapped(..))
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.is_mapped() { "mapped" } else { "owned" };
        write!(f, "SharedBytes({} bytes, {kind})", self.len())
    }
}
