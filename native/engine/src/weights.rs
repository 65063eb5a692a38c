//! Reads safetensors checkpoints (single file or sharded) into MLX arrays.
//!
//! Files are memory-mapped and each tensor is copied once, straight from the
//! mapping into MLX's own buffer; the mapping is dropped after loading, so a
//! checkpoint file changed or deleted later cannot affect a loaded model.

use std::collections::{BTreeSet, HashMap};
use std::ffi::c_void;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::UncheckedAdvice;
use mlx_rs::{Array, Dtype};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

use crate::error::{read_json, Error, Result};

pub struct Weights {
    tensors: HashMap<String, Array>,
    pub bytes: usize,
}

impl Weights {
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let mut weights = Weights {
            tensors: HashMap::new(),
            bytes: 0,
        };
        for file in weight_files(dir)? {
            weights.load_file(&file)?;
        }
        Ok(weights)
    }

    fn load_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the mapping is read-only and lives only for this function; a
        // concurrent truncation would fault, which is the same risk every
        // mmap-based loader (mlx, safetensors, llama.cpp) accepts.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let st = SafeTensors::deserialize(&map).map_err(|e| Error::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let tensors = st.tensors();
        let bytes = tensors.iter().map(|(_, view)| view.data().len()).sum();
        crate::memory::ensure_fits(Some(bytes), &format!("loading {}", path.display()))?;
        let mut copies = Vec::with_capacity(tensors.len());
        for (name, view) in tensors {
            let dtype = mlx_dtype(view.dtype()).ok_or_else(|| Error::Safetensors {
                path: path.to_path_buf(),
                message: format!("tensor `{name}` has unsupported dtype {:?}", view.dtype()),
            })?;
            let shape = view
                .shape()
                .iter()
                .map(|&d| i32::try_from(d))
                .collect::<Result<Vec<i32>, _>>()
                .map_err(|_| Error::Safetensors {
                    path: path.to_path_buf(),
                    message: format!("tensor `{name}` is too large"),
                })?;
            copies.push(TensorCopy {
                name,
                shape,
                dtype,
                data: view.data(),
            });
        }
        for (name, array) in copy_in_parallel(copies, &map, path)? {
            self.tensors.insert(name, array);
        }
        self.bytes += bytes;
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Drops the tensors whose names match `unused`.
    pub fn discard(&mut self, unused: impl Fn(&str) -> bool) {
        self.tensors.retain(|name, _| !unused(name));
    }

    /// The names of the tensors not taken yet, sorted.
    pub fn remaining(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    /// Removes and returns a tensor, checking its shape where one is expected.
    pub fn take(&mut self, name: &str, expected: Option<&[i32]>) -> Result<Array> {
        let array = self
            .tensors
            .remove(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        if let Some(expected) = expected {
            if array.shape() != expected {
                return Err(Error::ShapeMismatch {
                    name: name.to_string(),
                    expected: expected.iter().map(|&d| d as i64).collect(),
                    got: array.shape().iter().map(|&d| d as i64).collect(),
                });
            }
        }
        Ok(array)
    }
}

/// One tensor to copy out of a mapped file.
struct TensorCopy<'a> {
    name: String,
    shape: Vec<i32>,
    dtype: Dtype,
    data: &'a [u8],
}

/// Copies the tensors into MLX arrays on several threads at once. The copy
/// is bound by first touches of fresh pages (the mapping's and, on CUDA, the
/// unified memory MLX allocates), not by memory bandwidth, so spreading it
/// over cores cuts the load time on a many-core host roughly in proportion,
/// as MLX's own loader does with its I/O thread pool.
fn copy_in_parallel(
    mut copies: Vec<TensorCopy<'_>>,
    map: &memmap2::Mmap,
    path: &Path,
) -> Result<Vec<(String, Array)>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(copies.len().max(1));
    // Largest first onto the least loaded thread keeps the threads even.
    copies.sort_by_key(|c| std::cmp::Reverse(c.data.len()));
    let mut shares: Vec<(usize, Vec<TensorCopy<'_>>)> =
        (0..threads).map(|_| (0, Vec::new())).collect();
    for copy in copies {
        let share = shares.iter_mut().min_by_key(|(bytes, _)| *bytes).unwrap();
        share.0 += copy.data.len();
        share.1.push(copy);
    }
    std::thread::scope(|scope| {
        let workers: Vec<_> = shares
            .into_iter()
            .map(|(_, share)| scope.spawn(move || copy_share(share, map, path)))
            .collect();
        let mut arrays = Vec::new();
        for worker in workers {
            let share = worker.join().map_err(|_| {
                Error::Mlx(format!("copying tensors from {} failed", path.display()))
            })??;
            arrays.extend(share);
        }
        Ok(arrays)
    })
}

fn copy_share(
    share: Vec<TensorCopy<'_>>,
    map: &memmap2::Mmap,
    path: &Path,
) -> Result<Vec<(String, Array)>> {
    crate::device::install_error_handler();
    let mut arrays = Vec::with_capacity(share.len());
    for TensorCopy {
        name,
        shape,
        dtype,
        data,
    } in share
    {
        // SAFETY: safetensors checked that `data` holds exactly shape x dtype bytes.
        let array = unsafe { Array::from_raw_data(data.as_ptr() as *const c_void, &shape, dtype) };
        // A failed creation (e.g. a device left unusable by an earlier
        // fault) yields an empty array rather than an error: say so here,
        // not later as a misleading shape mismatch.
        if array.shape() != shape.as_slice() {
            return Err(Error::Mlx(format!(
                "MLX could not create tensor `{name}` from {}",
                path.display()
            )));
        }
        // MLX now holds its own copy: drop the file's pages from this
        // process so that loading peaks near one copy of the weights, not
        // two. Best effort; the pages are file-backed and unmodified, so
        // reading them again would only fetch the same bytes.
        let offset = data.as_ptr() as usize - map.as_ptr() as usize;
        // SAFETY: the range lies inside the mapping.
        let _ =
            unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, offset, data.len()) };
        arrays.push((name, array));
    }
    Ok(arrays)
}

fn mlx_dtype(dtype: StDtype) -> Option<Dtype> {
    Some(match dtype {
        StDtype::F32 => Dtype::Float32,
        StDtype::F16 => Dtype::Float16,
        StDtype::BF16 => Dtype::Bfloat16,
        StDtype::U32 => Dtype::Uint32,
        StDtype::I32 => Dtype::Int32,
        StDtype::U8 => Dtype::Uint8,
        StDtype::I8 => Dtype::Int8,
        StDtype::I64 => Dtype::Int64,
        StDtype::BOOL => Dtype::Bool,
        _ => return None,
    })
}

/// The shards named by `model.safetensors.index.json`, else every
/// `model*.safetensors` in the folder (as mlx-lm globs them).
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let json = read_json(&index)?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::Json {
                path: index.clone(),
                message: "missing object `weight_map`".into(),
            })?;
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| Error::Json {
                path: index.clone(),
                message: format!("weight_map entry for `{tensor}` is not a file name"),
            })?;
            if file.contains('/') || file.contains('\\') {
                return Err(Error::invalid(format!(
                    "shard name `{file}` must be a plain file name"
                )));
            }
            files.insert(dir.join(file));
        }
        for file in &files {
            if !file.exists() {
                return Err(Error::io(
                    file,
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "shard named in model.safetensors.index.json is missing",
                    ),
                ));
            }
        }
        return Ok(files.into_iter().collect());
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::io(
            dir,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no model*.safetensors weights in this folder",
            ),
        ));
    }
    Ok(files)
}

#[cfg(test)]
impl Weights {
    /// Tensors given by name, as if read from a checkpoint.
    pub(crate) fn from_arrays(tensors: impl IntoIterator<Item = (String, Array)>) -> Self {
        Weights {
            tensors: tensors.into_iter().collect(),
            bytes: 0,
        }
    }
}

#[cfg(test)]
impl Weights {
    /// A tensor, left in place.
    pub(crate) fn tensors_for_test(&self, name: &str) -> Array {
        self.tensors[name].clone()
    }
}
