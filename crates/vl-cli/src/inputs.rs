//! The images a run takes: paths and directories on the command line, a
//! list file (`--files-from`), and one shard of them (`--shard I/N`).

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

/// File extensions taken from a directory.
const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "gif", "bmp", "tif", "tiff", "webp"];

/// Expands directories into their image files, sorted; files stay as given.
pub fn expand(inputs: &[PathBuf]) -> (Vec<PathBuf>, Vec<(PathBuf, anyhow::Error)>) {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for p in inputs {
        if p.is_dir() {
            let entries = match std::fs::read_dir(p) {
                Ok(entries) => entries,
                Err(e) => {
                    problems.push((p.clone(), anyhow::anyhow!("cannot list the directory: {e}")));
                    continue;
                }
            };
            let mut files: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|f| {
                    f.extension().and_then(|e| e.to_str()).is_some_and(|e| {
                        IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str())
                    })
                })
                .collect();
            if files.is_empty() {
                problems.push((
                    p.clone(),
                    anyhow::anyhow!(
                        "a directory with no images (looked for {})",
                        IMAGE_EXTENSIONS.join(", ")
                    ),
                ));
            }
            files.sort();
            out.extend(files);
        } else {
            out.push(p.clone());
        }
    }
    (out, problems)
}

/// Reads a list of image paths, one per line, from `path` (`-`: standard
/// input). Blank lines and lines starting with `#` are skipped; relative
/// paths are taken as they are (relative to the working directory).
pub fn read_list(path: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let name = || format!("--files-from {}", path.display());
    let reader: Box<dyn BufRead> = if path == Path::new("-") {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(std::io::BufReader::new(
            std::fs::File::open(path).with_context(name)?,
        ))
    };
    let mut out = Vec::new();
    for line in reader.lines() {
        let line = line.with_context(name)?;
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(PathBuf::from(line));
    }
    Ok(out)
}

/// One of `count` shards of a run (`--shard index/count`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    /// Which shard, `0..count`.
    pub index: usize,
    /// How many shards.
    pub count: usize,
}

impl Shard {
    /// Parses `I/N` with `I < N`.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let Some((i, n)) = text.split_once('/') else {
            bail!("`{text}`: expected I/N, e.g. 0/4");
        };
        let index: usize = i
            .trim()
            .parse()
            .with_context(|| format!("`{text}`: the shard index `{i}` is not a number"))?;
        let count: usize = n
            .trim()
            .parse()
            .with_context(|| format!("`{text}`: the shard count `{n}` is not a number"))?;
        if count == 0 {
            bail!("`{text}`: the shard count must be at least 1");
        }
        if index >= count {
            bail!(
                "`{text}`: the shard index must be below the count {count} (shards are 0..{count})"
            );
        }
        Ok(Self { index, count })
    }

    /// This shard's part of `items`: the items sorted by path, cut into
    /// `count` contiguous runs whose lengths differ by at most one, the
    /// `index`-th run. The runs of shards `0..count`, concatenated, are the
    /// sorted items, each exactly once.
    pub fn select<T: Keyed>(self, mut items: Vec<T>) -> Vec<T> {
        items.sort_by(|a, b| a.key().cmp(b.key()));
        let (n, k) = (items.len(), self.count);
        let start = self.index * (n / k) + self.index.min(n % k);
        let len = n / k + usize::from(self.index < n % k);
        items.into_iter().skip(start).take(len).collect()
    }
}

/// An item that [`Shard::select`] orders by its path.
pub trait Keyed {
    /// The path the item is sorted by.
    fn key(&self) -> &Path;
}

impl Keyed for PathBuf {
    fn key(&self) -> &Path {
        self
    }
}

impl<E> Keyed for (PathBuf, E) {
    fn key(&self) -> &Path {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_partition_the_sorted_inputs() {
        for n_items in [0usize, 1, 2, 5, 7, 16] {
            let items: Vec<PathBuf> = (0..n_items)
                .rev()
                .map(|i| PathBuf::from(format!("img_{i:03}.png")))
                .collect();
            let mut sorted = items.clone();
            sorted.sort();
            for count in 1..=5 {
                let joined: Vec<PathBuf> = (0..count)
                    .flat_map(|index| Shard { index, count }.select(items.clone()))
                    .collect();
                assert_eq!(joined, sorted, "{n_items} items, {count} shards");
                let lens: Vec<usize> = (0..count)
                    .map(|index| Shard { index, count }.select(items.clone()).len())
                    .collect();
                let (lo, hi) = (lens.iter().min(), lens.iter().max());
                assert!(hi.zip(lo).is_none_or(|(h, l)| h - l <= 1), "{lens:?}");
            }
        }
    }

    #[test]
    fn shard_flags_parse_or_name_the_problem() {
        assert_eq!(Shard::parse("1/4").ok(), Some(Shard { index: 1, count: 4 }));
        for (text, says) in [
            ("4/4", "below the count"),
            ("0/0", "at least 1"),
            ("a/2", "index"),
            ("2", "I/N"),
        ] {
            let err = Shard::parse(text).unwrap_err().to_string();
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn list_files_skip_blanks_and_comments() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let list = dir.path().join("list.txt");
        std::fs::write(&list, "a.png\n\n# note\nb/c.jpg\r\n")?;
        assert_eq!(
            read_list(&list)?,
            vec![PathBuf::from("a.png"), PathBuf::from("b/c.jpg")]
        );
        let err = read_list(&dir.path().join("nope")).unwrap_err();
        assert!(format!("{err:#}").contains("--files-from"), "{err:#}");
        Ok(())
    }
}
