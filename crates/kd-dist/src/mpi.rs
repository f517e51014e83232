//! The MPI library, opened at run time: the dozen functions data-parallel training needs,
//! with Open MPI's ABI (handles are addresses of the library's predefined objects,
//! `MPI_IN_PLACE` is 1). MPICH-ABI libraries (MPICH, Intel MPI, MVAPICH) use integer handles
//! and are refused by name rather than misread.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use crate::error::{DistError, Result};

type Handle = *mut c_void;

/// Open MPI's `MPI_IN_PLACE`.
const IN_PLACE: *mut c_void = ptr::without_provenance_mut(1);
/// `MPI_THREAD_SERIALIZED`.
const THREAD_SERIALIZED: c_int = 2;
/// Open MPI's `MPI_COMM_TYPE_SHARED`.
const COMM_TYPE_SHARED: c_int = 0;
/// The largest element count one MPI call takes (`int`); longer buffers go in pieces.
const MAX_COUNT: usize = 1 << 30;

/// The library names tried when `KD_MPI_LIB` does not name one: Open MPI 3, 4 and 5 keep the
/// soname `libmpi.so.40`.
const CANDIDATES: [&str; 2] = ["libmpi.so.40", "libmpi.so"];

type InitThread = unsafe extern "C" fn(*mut c_int, *mut c_void, c_int, *mut c_int) -> c_int;
type Flag = unsafe extern "C" fn(*mut c_int) -> c_int;
type CommInt = unsafe extern "C" fn(Handle, *mut c_int) -> c_int;
type SplitType = unsafe extern "C" fn(Handle, c_int, c_int, Handle, *mut Handle) -> c_int;
type CommFree = unsafe extern "C" fn(*mut Handle) -> c_int;
type Allreduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, c_int, Handle, Handle, Handle) -> c_int;
type Allgather =
    unsafe extern "C" fn(*const c_void, c_int, Handle, *mut c_void, c_int, Handle, Handle) -> c_int;
type Allgatherv = unsafe extern "C" fn(
    *const c_void,
    c_int,
    Handle,
    *mut c_void,
    *const c_int,
    *const c_int,
    Handle,
    Handle,
) -> c_int;
type Barrier = unsafe extern "C" fn(Handle) -> c_int;
type Abort = unsafe extern "C" fn(Handle, c_int) -> c_int;
type Finalize = unsafe extern "C" fn() -> c_int;
type LibraryVersion = unsafe extern "C" fn(*mut c_char, *mut c_int) -> c_int;

/// An initialised MPI library and the handles of `MPI_COMM_WORLD`.
pub(crate) struct Mpi {
    /// Kept open for as long as the function pointers below are used.
    _lib: Library,
    /// Where it was loaded from.
    pub path: String,
    /// `MPI_Get_library_version`'s first line.
    pub version: String,
    comm_world: Handle,
    float: Handle,
    double: Handle,
    int: Handle,
    byte: Handle,
    sum: Handle,
    allreduce: Allreduce,
    allgather: Allgather,
    allgatherv: Allgatherv,
    barrier: Barrier,
    abort: Abort,
    finalize: Finalize,
}

// SAFETY: the handles are addresses of objects that live in the loaded library for the life of
// the process; `World` serialises every call through a mutex, and MPI is initialised with
// MPI_THREAD_SERIALIZED, which allows calls from any one thread at a time.
unsafe impl Send for Mpi {}
// SAFETY: as above: every call goes through `World`'s mutex.
unsafe impl Sync for Mpi {}

/// Reads a function or object address from `lib`.
fn symbol<T: Copy>(lib: &Library, path: &str, name: &str) -> Result<T> {
    let c = format!("{name}\0");
    // SAFETY: each call site names T as the C declaration in Open MPI's mpi.h gives it (a
    // function pointer type, or a pointer to a predefined object for handles).
    unsafe { lib.get::<T>(c.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| {
            DistError::Library(format!(
                "{path} has no symbol {name} ({e}): it is not an Open MPI library of a \
             version this build speaks to (Open MPI 3–5)"
            ))
        })
}

fn check(call: &'static str, code: c_int) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(DistError::Call {
            call,
            code,
            detail: None,
        })
    }
}

fn count(n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        DistError::Usage(format!(
            "{what}: {n} elements do not fit one MPI call's count"
        ))
    })
}

impl Mpi {
    /// Opens the library (`KD_MPI_LIB`, or Open MPI's soname) and initialises MPI.
    pub fn open(env_path: Option<String>, launcher: &str) -> Result<Self> {
        let names: Vec<String> = match &env_path {
            Some(p) => vec![p.clone()],
            None => CANDIDATES.iter().map(|s| s.to_string()).collect(),
        };
        let mut errors = Vec::new();
        let mut opened = None;
        for name in &names {
            // SAFETY: loading a shared library runs its initialisers; Open MPI's do not touch
            // this process's Rust state. RTLD_GLOBAL: Open MPI's components, loaded by the
            // library with dlopen, resolve its symbols globally.
            match unsafe { Library::open(Some(name), RTLD_NOW | RTLD_GLOBAL) } {
                Ok(lib) => {
                    opened = Some((lib, name.clone()));
                    break;
                }
                Err(e) => errors.push(format!("{name}: {e}")),
            }
        }
        let Some((lib, path)) = opened else {
            return Err(DistError::Library(format!(
                "this process was started by an MPI launcher ({launcher} is set) but no MPI \
                 library could be opened ({}). Install Open MPI (Debian/Ubuntu: `apt-get \
                 install openmpi-bin`), or set KD_MPI_LIB to the path of its libmpi.so",
                errors.join("; ")
            )));
        };
        let version_fn: LibraryVersion = symbol(&lib, &path, "MPI_Get_library_version")?;
        let mut buf = vec![0 as c_char; 8192];
        let mut len: c_int = 0;
        // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING of every MPI; this
        // function may be called before MPI_Init.
        check("MPI_Get_library_version", unsafe {
            version_fn(buf.as_mut_ptr(), &mut len)
        })?;
        // SAFETY: MPI wrote a NUL-terminated string into the zeroed buffer.
        let version = unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        if !version.contains("Open MPI") {
            return Err(DistError::Library(format!(
                "{path} is \"{version}\": this build speaks Open MPI's ABI only (MPICH, Intel \
                 MPI and MVAPICH use another). Install Open MPI and launch with its mpirun, or \
                 set KD_MPI_LIB to Open MPI's libmpi.so.40"
            )));
        }
        let init_thread: InitThread = symbol(&lib, &path, "MPI_Init_thread")?;
        let initialized: Flag = symbol(&lib, &path, "MPI_Initialized")?;
        let object = |name| symbol::<Handle>(&lib, &path, name);
        let mpi = Self {
            comm_world: object("ompi_mpi_comm_world")?,
            float: object("ompi_mpi_float")?,
            double: object("ompi_mpi_double")?,
            int: object("ompi_mpi_int")?,
            byte: object("ompi_mpi_byte")?,
            sum: object("ompi_mpi_op_sum")?,
            allreduce: symbol(&lib, &path, "MPI_Allreduce")?,
            allgather: symbol(&lib, &path, "MPI_Allgather")?,
            allgatherv: symbol(&lib, &path, "MPI_Allgatherv")?,
            barrier: symbol(&lib, &path, "MPI_Barrier")?,
            abort: symbol(&lib, &path, "MPI_Abort")?,
            finalize: symbol(&lib, &path, "MPI_Finalize")?,
            version,
            path,
            _lib: lib,
        };
        let mut flag: c_int = 0;
        // SAFETY: MPI_Initialized may be called at any time.
        check("MPI_Initialized", unsafe { initialized(&mut flag) })?;
        if flag == 0 {
            let mut provided: c_int = 0;
            // SAFETY: MPI_Init_thread accepts NULL argc/argv (MPI-2); called once per process
            // (World is initialised once).
            check("MPI_Init_thread", unsafe {
                init_thread(
                    ptr::null_mut(),
                    ptr::null_mut(),
                    THREAD_SERIALIZED,
                    &mut provided,
                )
            })?;
            if provided < THREAD_SERIALIZED {
                tracing::debug!(
                    provided,
                    "MPI gives less than MPI_THREAD_SERIALIZED; collectives stay on one thread"
                );
            }
        }
        Ok(mpi)
    }

    /// Rank and size in `MPI_COMM_WORLD`, and rank and size among the ranks of this machine.
    pub fn ranks(&self) -> Result<(usize, usize, usize, usize)> {
        let lib = &self._lib;
        let comm_rank: CommInt = symbol(lib, &self.path, "MPI_Comm_rank")?;
        let comm_size: CommInt = symbol(lib, &self.path, "MPI_Comm_size")?;
        let split: SplitType = symbol(lib, &self.path, "MPI_Comm_split_type")?;
        let free: CommFree = symbol(lib, &self.path, "MPI_Comm_free")?;
        let info_null: Handle = symbol(lib, &self.path, "ompi_mpi_info_null")?;
        let (mut rank, mut size, mut local_rank, mut local_size) = (0, 0, 0, 0);
        let mut node: Handle = ptr::null_mut();
        // SAFETY: MPI is initialised; the handles come from the same library; the out-pointers
        // are valid locals.
        unsafe {
            check("MPI_Comm_rank", comm_rank(self.comm_world, &mut rank))?;
            check("MPI_Comm_size", comm_size(self.comm_world, &mut size))?;
            check(
                "MPI_Comm_split_type",
                split(
                    self.comm_world,
                    COMM_TYPE_SHARED,
                    rank,
                    info_null,
                    &mut node,
                ),
            )?;
            check("MPI_Comm_rank", comm_rank(node, &mut local_rank))?;
            check("MPI_Comm_size", comm_size(node, &mut local_size))?;
            check("MPI_Comm_free", free(&mut node))?;
        }
        let u = |v: c_int| usize::try_from(v).unwrap_or(0);
        Ok((u(rank), u(size), u(local_rank), u(local_size)))
    }

    fn allreduce_raw(&self, data: *mut c_void, len: usize, elem: usize, ty: Handle) -> Result<()> {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(MAX_COUNT);
            // SAFETY: `data` points to `len` elements of `elem` bytes (the caller's slice);
            // every rank calls with the same length and type (checked by the caller's
            // protocol: all ranks run the same program on the same plan).
            let code = unsafe {
                (self.allreduce)(
                    IN_PLACE,
                    data.cast::<u8>().add(at * elem).cast(),
                    n as c_int,
                    ty,
                    self.sum,
                    self.comm_world,
                )
            };
            check("MPI_Allreduce", code)?;
            at += n;
        }
        Ok(())
    }

    /// Element-wise sum over the ranks, in place.
    pub fn all_reduce_f32(&self, data: &mut [f32]) -> Result<()> {
        self.allreduce_raw(data.as_mut_ptr().cast(), data.len(), 4, self.float)
    }

    /// Element-wise sum over the ranks, in place.
    pub fn all_reduce_f64(&self, data: &mut [f64]) -> Result<()> {
        self.allreduce_raw(data.as_mut_ptr().cast(), data.len(), 8, self.double)
    }

    /// Every rank's bytes, in rank order.
    pub fn all_gather_bytes(&self, mine: &[u8], size: usize) -> Result<Vec<Vec<u8>>> {
        let my_len = count(mine.len(), "all_gather_bytes")?;
        let mut lens = vec![0 as c_int; size];
        // SAFETY: one int sent, `size` ints received into `lens`.
        check("MPI_Allgather", unsafe {
            (self.allgather)(
                (&my_len as *const c_int).cast(),
                1,
                self.int,
                lens.as_mut_ptr().cast(),
                1,
                self.int,
                self.comm_world,
            )
        })?;
        let mut displs = Vec::with_capacity(size);
        let mut total = 0usize;
        for l in &lens {
            displs.push(count(total, "all_gather_bytes")?);
            total += usize::try_from(*l).unwrap_or(0);
        }
        count(total, "all_gather_bytes")?;
        let mut all = vec![0u8; total];
        // SAFETY: `all` holds the sum of every rank's length; `lens` and `displs` describe it.
        check("MPI_Allgatherv", unsafe {
            (self.allgatherv)(
                mine.as_ptr().cast(),
                my_len,
                self.byte,
                all.as_mut_ptr().cast(),
                lens.as_ptr(),
                displs.as_ptr(),
                self.byte,
                self.comm_world,
            )
        })?;
        Ok(lens
            .iter()
            .zip(&displs)
            .map(|(l, d)| {
                let d = usize::try_from(*d).unwrap_or(0);
                all[d..d + usize::try_from(*l).unwrap_or(0)].to_vec()
            })
            .collect())
    }

    /// Waits for every rank.
    pub fn barrier(&self) -> Result<()> {
        // SAFETY: MPI is initialised; the communicator comes from the library.
        check("MPI_Barrier", unsafe { (self.barrier)(self.comm_world) })
    }

    /// Ends every rank of the job with `code`.
    pub fn abort(&self, code: i32) {
        // SAFETY: MPI is initialised; MPI_Abort does not return on success.
        unsafe {
            (self.abort)(self.comm_world, code);
        }
    }

    /// Shuts MPI down (collective: every rank calls it).
    pub fn finalize(&self) -> Result<()> {
        // SAFETY: MPI is initialised and no call follows.
        check("MPI_Finalize", unsafe { (self.finalize)() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_says_how_to_get_one() {
        let Err(e) = Mpi::open(
            Some("/nonexistent/libmpi.so.40".into()),
            "OMPI_COMM_WORLD_SIZE",
        ) else {
            panic!("opened a library that does not exist");
        };
        let e = e.to_string();
        assert!(
            e.contains("OMPI_COMM_WORLD_SIZE is set")
                && e.contains("openmpi-bin")
                && e.contains("KD_MPI_LIB"),
            "{e}"
        );
    }

    #[test]
    fn a_library_that_is_not_mpi_is_refused_by_name() {
        let Err(e) = Mpi::open(Some("libc.so.6".into()), "PMIX_RANK") else {
            panic!("took libc for MPI");
        };
        let e = e.to_string();
        assert!(
            e.contains("libc.so.6") && e.contains("MPI_Get_library_version"),
            "{e}"
        );
    }
}
