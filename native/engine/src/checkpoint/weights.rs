//! Reads safetensors checkpoints (single file or sharded) into MLX arrays.
//!
//! Files are memory-mapped and each tensor is copied once, straight from the
//! mapping into MLX's own buffer; the mapping is dropped after loading, so a
//! checkpoint file changed or deleted later cannot affect a loaded model.
//! Tensors the model reads stacked ([`Join`]) are copied side by side into
//! one buffer, so that loading runs nothing on the device: stacking them
//! there made the GPU read every part from unified memory and the host move
//! the result back (on an NVIDIA H200 a 0.6B checkpoint loaded in 220-260 ms
//! that way, in 67 ms now; mlx-lm took 142).

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
    /// Each joined tensor's members: their names and first dimensions.
    joined: HashMap<String, Vec<(String, i32)>>,
    pub bytes: usize,
}

/// Modules whose tensors the model reads stacked along the first axis, as
/// a layer's q/k/v or gate/up projections, named relative to their parent:
/// under every parent module where each member has the same tensors
/// (`{member}.weight`, `.scales`, ...), in any shards, each of the same
/// dtype and trailing shape, they are loaded as `{name}.weight`, ...
#[derive(Clone, Debug)]
pub struct Join {
    pub name: String,
    pub members: Vec<String>,
}

impl Join {
    /// The join under the module `parent`.
    pub fn at(&self, parent: &str) -> Join {
        let under = |name: &String| format!("{parent}.{name}");
        Join {
            name: under(&self.name),
            members: self.members.iter().map(under).collect(),
        }
    }
}

impl Weights {
    /// Loads every shard of the checkpoint in `dir`. Joins are made over
    /// the whole checkpoint, not file by file: transformers and mlx-lm may
    /// write one module's tensors (say its `biases` and its `weight`), or a
    /// join's members, to different shards.
    pub fn load_dir(dir: &Path, joins: &[Join]) -> Result<Self> {
        let files = weight_files(dir)?;
        let mut maps = Vec::with_capacity(files.len());
        for path in &files {
            let file = File::open(path).map_err(|e| Error::io(path, e))?;
            // SAFETY: the mapping is read-only and lives only for this
            // function; a concurrent truncation would fault, which is the same
            // risk every mmap-based loader (mlx, safetensors, llama.cpp) accepts.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
            maps.push((path.as_path(), map));
        }
        let mut parsed = Vec::with_capacity(maps.len());
        for (path, map) in &maps {
            let st = SafeTensors::deserialize(map).map_err(|e| Error::Safetensors {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
            parsed.push((*path, map, st));
        }
        // Every shard's tensors; where two shards hold the same name, the
        // later one's, as mlx-lm's loader keeps it.
        let mut views: HashMap<&str, View> = HashMap::new();
        for (path, map, st) in &parsed {
            for (name, view) in st.iter() {
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
                let part = Part {
                    data: view.data(),
                    map,
                    path,
                };
                views.insert(name, (shape, dtype, part));
            }
        }
        let bytes: usize = views.values().map(|(_, _, p)| p.data.len()).sum();
        let what = match files.as_slice() {
            [file] => format!("loading {}", file.display()),
            _ => format!("loading {} shards in {}", files.len(), dir.display()),
        };
        crate::runtime::memory::ensure_fits(Some(bytes), &what)?;
        let mut weights = Weights {
            tensors: HashMap::new(),
            joined: HashMap::new(),
            bytes,
        };
        // Each module's tensors (`{module}.{suffix}`), sorted.
        let mut modules: HashMap<String, Vec<String>> = HashMap::new();
        for name in views.keys() {
            if let Some((module, suffix)) = name.rsplit_once('.') {
                modules
                    .entry(module.to_string())
                    .or_default()
                    .push(suffix.to_string());
            }
        }
        modules.values_mut().for_each(|s| s.sort());
        let mut copies = Vec::with_capacity(views.len());
        let parents = |join: &Join| -> Vec<String> {
            let first = join.members.first().map_or("", String::as_str);
            let mut found: Vec<String> = modules
                .keys()
                .filter_map(|m| m.strip_suffix(first)?.strip_suffix('.'))
                .map(str::to_string)
                .collect();
            found.sort();
            found
        };
        for join in joins
            .iter()
            .flat_map(|j| parents(j).into_iter().map(|p| j.at(&p)))
        {
            if let Some(joined) = join_copies(&join, &modules, &mut views) {
                for (copy, members) in joined {
                    weights.joined.insert(copy.name.clone(), members);
                    copies.push(copy);
                }
            }
        }
        for (name, (shape, dtype, part)) in views {
            copies.push(TensorCopy {
                name: name.to_string(),
                shape,
                dtype,
                parts: vec![part],
            });
        }
        for (name, array) in copy_in_parallel(copies)? {
            weights.tensors.insert(name, array);
        }
        Ok(weights)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Drops the tensors whose names match `unused`.
    pub fn discard(&mut self, unused: impl Fn(&str) -> bool) {
        self.tensors.retain(|name, _| !unused(name));
    }

    /// The checkpoint's names of the tensors not taken yet, sorted.
    pub fn remaining(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for name in self.tensors.keys() {
            match self.joined.get(name) {
                Some(members) => names.extend(members.iter().map(|(m, _)| m.clone())),
                None => names.push(name.clone()),
            }
        }
        names.sort();
        names
    }

    /// The first dimensions of a joined tensor's members, where `name` was
    /// loaded joined (see [`Join`]) and is not taken yet.
    pub fn joined_rows(&self, name: &str) -> Option<Vec<i32>> {
        let members = self.joined.get(name)?;
        self.tensors
            .contains_key(name)
            .then(|| members.iter().map(|(_, rows)| *rows).collect())
    }

    /// Puts the members of the joined tensors `{prefix}.*` back under their
    /// own names, as views of the joined ones, for a reader that takes them
    /// apart after all.
    pub fn unjoin(&mut self, prefix: &str) {
        let start = format!("{prefix}.");
        let names: Vec<String> = self
            .joined
            .keys()
            .filter(|n| n.starts_with(&start))
            .cloned()
            .collect();
        for name in names {
            let (Some(array), Some(members)) =
                (self.tensors.remove(&name), self.joined.remove(&name))
            else {
                continue;
            };
            let mut at = 0;
            for (member, rows) in members {
                let part = mlx_rs::ops::indexing::IndexOp::index(&array, at..at + rows);
                self.tensors.insert(member, part);
                at += rows;
            }
        }
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

/// A tensor's bytes in a mapped shard, with the mapping and its file.
#[derive(Clone, Copy)]
struct Part<'a> {
    data: &'a [u8],
    map: &'a memmap2::Mmap,
    path: &'a Path,
}

/// One tensor to copy out of the mapped shards: its bytes, or a joined
/// tensor's members' bytes one after another (from any shards).
struct TensorCopy<'a> {
    name: String,
    shape: Vec<i32>,
    dtype: Dtype,
    parts: Vec<Part<'a>>,
}

impl TensorCopy<'_> {
    fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }
}

/// A tensor of a mapped shard: shape, dtype, bytes.
type View<'a> = (Vec<i32>, Dtype, Part<'a>);

/// A joined tensor's members: names and first dimensions.
type Members = Vec<(String, i32)>;

/// A join's tensors as copies, each with its members, where the checkpoint
/// holds the same tensors of every member (taken out of `views`); `None`
/// where it does not.
fn join_copies<'a>(
    join: &Join,
    modules: &HashMap<String, Vec<String>>,
    views: &mut HashMap<&str, View<'a>>,
) -> Option<Vec<(TensorCopy<'a>, Members)>> {
    let first = join.members.first()?;
    let wanted = modules.get(first)?;
    if join.members.iter().any(|m| modules.get(m) != Some(wanted)) {
        return None;
    }
    for suffix in wanted {
        if views.contains_key(format!("{}.{suffix}", join.name).as_str()) {
            return None;
        }
        let (shape, dtype, _) = views.get(format!("{first}.{suffix}").as_str())?;
        let same = join.members.iter().all(|m| {
            views
                .get(format!("{m}.{suffix}").as_str())
                .is_some_and(|(s, d, _)| d == dtype && !s.is_empty() && s[1..] == shape[1..])
        });
        if !same {
            return None;
        }
    }
    let mut copies = Vec::with_capacity(wanted.len());
    for suffix in wanted {
        let mut parts = Vec::with_capacity(join.members.len());
        let mut members = Vec::with_capacity(join.members.len());
        let mut shape = Vec::new();
        let mut dtype = Dtype::Float32;
        for m in &join.members {
            let name = format!("{m}.{suffix}");
            let (s, d, data) = views.remove(name.as_str())?;
            members.push((name, s[0]));
            parts.push(data);
            if shape.is_empty() {
                (shape, dtype) = (s, d);
            } else {
                shape[0] = shape[0].checked_add(s[0])?;
            }
        }
        let name = format!("{}.{suffix}", join.name);
        copies.push((
            TensorCopy {
                name,
                shape,
                dtype,
                parts,
            },
            members,
        ));
    }
    Some(copies)
}

/// Copies the tensors into MLX arrays on several threads at once. The copy
/// is bound by first touches of fresh pages (the mapping's and, on CUDA, the
/// unified memory MLX allocates), not by memory bandwidth, so spreading it
/// over cores cuts the load time on a many-core host roughly in proportion,
/// as MLX's own loader does with its I/O thread pool.
fn copy_in_parallel(mut copies: Vec<TensorCopy<'_>>) -> Result<Vec<(String, Array)>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(copies.len().max(1));
    // Largest first onto the least loaded thread keeps the threads even.
    copies.sort_by_key(|c| std::cmp::Reverse(c.bytes()));
    let mut shares: Vec<(usize, Vec<TensorCopy<'_>>)> =
        (0..threads).map(|_| (0, Vec::new())).collect();
    for copy in copies {
        let share = shares.iter_mut().min_by_key(|(bytes, _)| *bytes).unwrap();
        share.0 += copy.bytes();
        share.1.push(copy);
    }
    std::thread::scope(|scope| {
        let workers: Vec<_> = shares
            .into_iter()
            .map(|(_, share)| scope.spawn(move || copy_share(share)))
            .collect();
        let mut arrays = Vec::new();
        for worker in workers {
            let share = worker
                .join()
                .map_err(|_| Error::Mlx("copying the checkpoint's tensors failed".into()))??;
            arrays.extend(share);
        }
        Ok(arrays)
    })
}

fn copy_share(share: Vec<TensorCopy<'_>>) -> Result<Vec<(String, Array)>> {
    crate::runtime::device::prepare_mlx();
    let mut arrays = Vec::with_capacity(share.len());
    for copy in share {
        let array = copy_tensor(&copy).ok_or_else(|| {
            // A failed creation (e.g. a device left unusable by an earlier
            // fault): say so here, not later as a misleading shape mismatch.
            let path = copy.parts.first().map_or(Path::new("?"), |p| p.path);
            Error::Mlx(format!(
                "MLX could not create tensor `{}` from {}",
                copy.name,
                path.display()
            ))
        })?;
        // MLX now holds its own copy: drop the file's pages from this
        // process so that loading peaks near one copy of the weights, not
        // two. Best effort; the pages are file-backed and unmodified, so
        // reading them again would only fetch the same bytes.
        for part in &copy.parts {
            let offset = part.data.as_ptr() as usize - part.map.as_ptr() as usize;
            // SAFETY: the range lies inside the part's mapping.
            let _ = unsafe {
                part.map
                    .unchecked_advise_range(UncheckedAdvice::DontNeed, offset, part.data.len())
            };
        }
        arrays.push((copy.name, array));
    }
    Ok(arrays)
}

/// One MLX array holding the copy's parts in order; `None` where MLX could
/// not make one.
fn copy_tensor(copy: &TensorCopy) -> Option<Array> {
    let TensorCopy {
        shape,
        dtype,
        parts,
        ..
    } = copy;
    if let [part] = parts.as_slice() {
        // SAFETY: safetensors checked that `data` holds exactly shape x dtype bytes.
        let array =
            unsafe { Array::from_raw_data(part.data.as_ptr() as *const c_void, shape, *dtype) };
        return (array.shape() == shape.as_slice()).then_some(array);
    }
    // SAFETY: an empty handle, for the call below to fill.
    let mut raw = unsafe { mlx_sys::mlx_array_new() };
    let mut dest: *mut c_void = std::ptr::null_mut();
    // SAFETY: `shape` outlives the call; MLX writes a new array and its
    // buffer's pointer.
    let status = unsafe {
        mlx_sys::emlx_array_new_uninit(
            &mut raw,
            &mut dest,
            shape.as_ptr(),
            shape.len() as i32,
            *dtype as mlx_sys::mlx_dtype,
        )
    };
    // SAFETY: `raw` is an array handle MLX-C made (empty where it failed),
    // now owned here.
    let array = unsafe { Array::from_ptr(raw) };
    if status != 0 || array.shape() != shape.as_slice() || array.nbytes() != copy.bytes() {
        return None;
    }
    let mut at = 0;
    for Part { data, .. } in parts {
        if data.is_empty() {
            continue;
        }
        // SAFETY: `dest` is the new buffer of `copy.bytes()` bytes, which no
        // one else holds yet; the parts fill it in order without overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), (dest as *mut u8).add(at), data.len())
        };
        at += data.len();
    }
    Some(array)
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
            joined: HashMap::new(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, rows: usize, cols: usize, seed: f32) -> (String, Vec<usize>, Vec<u8>) {
        let values: Vec<f32> = (0..rows * cols).map(|i| seed + i as f32).collect();
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        (name.to_string(), vec![rows, cols], bytes)
    }

    fn values(a: &Array) -> Vec<f32> {
        a.as_dtype(Dtype::Float32)
            .unwrap()
            .as_slice::<f32>()
            .to_vec()
    }

    /// Members with the same tensors are copied side by side under the
    /// joined name and can be taken apart again; a parent whose members
    /// differ in trailing shape, or lack a tensor, keeps them apart.
    #[test]
    fn joins_members_into_one_tensor_where_they_match() {
        let dir = std::env::temp_dir().join(format!("emlx-join-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tensors = [
            tensor("l.0.p.a.weight", 2, 4, 0.0),
            tensor("l.0.p.b.weight", 3, 4, 100.0),
            tensor("l.0.p.a.scales", 2, 1, 200.0),
            tensor("l.0.p.b.scales", 3, 1, 300.0),
            tensor("l.1.p.a.weight", 2, 4, 400.0),
            tensor("l.1.p.b.weight", 3, 5, 500.0),
            tensor("l.2.p.a.weight", 2, 4, 600.0),
            tensor("l.2.p.b.weight", 3, 4, 700.0),
            tensor("l.2.p.a.scales", 2, 1, 800.0),
        ];
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, shape, bytes)| {
                let view = safetensors::tensor::TensorView::new(StDtype::F32, shape.clone(), bytes)
                    .unwrap();
                (n.clone(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let join = Join {
            name: "p.ab".into(),
            members: vec!["p.a".into(), "p.b".into()],
        };
        let mut w = Weights::load_dir(&dir, &[join]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();

        assert_eq!(w.joined_rows("l.0.p.ab.weight"), Some(vec![2, 3]));
        assert_eq!(w.joined_rows("l.1.p.ab.weight"), None);
        assert_eq!(w.joined_rows("l.2.p.ab.weight"), None);
        let original = |name: &str| {
            let (_, _, bytes) = tensors.iter().find(|(n, ..)| n == name).unwrap();
            let v: Vec<f32> = bytes
                .chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            v
        };
        let joined = w.tensors_for_test("l.0.p.ab.weight");
        assert_eq!(joined.shape(), &[5, 4]);
        let both = [original("l.0.p.a.weight"), original("l.0.p.b.weight")].concat();
        assert_eq!(values(&joined), both);
        let scales = w.tensors_for_test("l.0.p.ab.scales");
        assert_eq!(scales.shape(), &[5, 1]);
        // The checkpoint's own names, joined or not.
        let remaining = w.remaining();
        assert!(
            remaining.contains(&"l.0.p.b.scales".to_string()),
            "{remaining:?}"
        );
        assert!(
            !remaining.iter().any(|n| n.contains("p.ab")),
            "{remaining:?}"
        );
        assert_eq!(remaining.len(), tensors.len());

        w.unjoin("l.0.p.ab");
        assert_eq!(w.joined_rows("l.0.p.ab.weight"), None);
        for name in ["l.0.p.a.weight", "l.0.p.b.weight", "l.0.p.b.scales"] {
            let got = w.take(name, None).unwrap();
            assert_eq!(values(&got), original(name), "{name}");
        }
        assert_eq!(w.remaining().len(), tensors.len() - 3);
    }
}
