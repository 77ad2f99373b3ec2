//! One download: stream the source into a hidden partial file, hashing as
//! the bytes pass, and name it by its digest only once the digest matches.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::ImageError;
use crate::state::atomic::sync_dir;

/// Bytes read and hashed per step.
const BLOCK: usize = 1 << 20;
/// Blocks in flight between the download and the hasher.
const PIPELINE: usize = 4;
/// Progress is reported at most this often.
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// Fetches `url` into `dir/<sha256>`, verifying it. `progress` gets
/// (done, total when known) at a bounded rate.
pub(super) fn fetch(
    agent: &ureq::Agent,
    dir: &Path,
    url: &str,
    sha256: &str,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<PathBuf, ImageError> {
    let (reader, total) = open(agent, url)?;
    let partial = dir.join(format!(".partial-{sha256}-{}", std::process::id()));
    let result = stream(reader, total, &partial, sha256, url, progress).and_then(|()| {
        match super::format::foreign_format(&partial) {
            Ok(None) => {}
            Ok(Some(format)) => {
                return Err(ImageError::NotRaw {
                    url: url.into(),
                    format,
                });
            }
            Err(e) => return Err(ImageError::store(partial.clone(), e)),
        }
        crate::crash::point("image.fetched");
        let target = dir.join(sha256);
        fs::rename(&partial, &target).map_err(|e| ImageError::store(target.clone(), e))?;
        sync_dir(dir).map_err(|e| ImageError::store(dir.to_path_buf(), e))?;
        crate::crash::point("image.stored");
        Ok(target)
    });
    if result.is_err() {
        // Never leave a partial download that looks like progress.
        let _ = fs::remove_file(&partial);
    }
    result
}

fn open(agent: &ureq::Agent, url: &str) -> Result<(Box<dyn Read + Send>, Option<u64>), ImageError> {
    if let Some(path) = url.strip_prefix("file://") {
        let path = Path::new(path);
        if !path.is_absolute() {
            return Err(ImageError::BadUrl {
                url: url.into(),
                why: "a file URL needs an absolute path (file:///srv/images/x.raw)".into(),
            });
        }
        let file = File::open(path).map_err(|e| ImageError::Source {
            url: url.into(),
            permanent: e.kind() == io::ErrorKind::NotFound,
            why: e.to_string(),
        })?;
        let len = file.metadata().ok().map(|m| m.len());
        return Ok((Box::new(file), len));
    }
    let scheme_ok =
        url.starts_with("http://") || (cfg!(feature = "tls") && url.starts_with("https://"));
    if !scheme_ok {
        return Err(ImageError::BadUrl {
            url: url.into(),
            why: if url.starts_with("https://") {
                "this build has no TLS; serve the image over http:// or file://, or build with --features tls".into()
            } else {
                "only http://, https:// and file:// images are served".into()
            },
        });
    }
    let response = agent.get(url).call().map_err(|e| ImageError::Source {
        url: url.into(),
        permanent: false,
        why: e.to_string(),
    })?;
    let status = response.status().as_u16();
    if status != 200 {
        // A 4xx will not change by asking again, except timeouts and
        // rate limits; a 5xx might.
        let permanent = (400..500).contains(&status) && status != 408 && status != 429;
        return Err(ImageError::Source {
            url: url.into(),
            permanent,
            why: format!("the server answered {status}"),
        });
    }
    let total = response
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let reader = response
        .into_body()
        .into_with_config()
        .limit(u64::MAX)
        .reader();
    Ok((Box::new(reader), total))
}

fn stream(
    mut reader: Box<dyn Read + Send>,
    total: Option<u64>,
    partial: &Path,
    sha256: &str,
    url: &str,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<(), ImageError> {
    let store_err = |source| ImageError::store(partial.to_path_buf(), source);
    let mut out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(partial)
        .map_err(store_err)?;
    // Hashing runs on its own thread, fed the blocks this one has read and
    // written: a download then takes as long as the slower of the network
    // and the hash, not both. Blocks go back through `spare` for reuse.
    let (full_tx, full_rx) = crossbeam_channel::bounded::<(Vec<u8>, usize)>(PIPELINE);
    let (spare_tx, spare_rx) = crossbeam_channel::bounded::<Vec<u8>>(PIPELINE + 1);
    for _ in 0..=PIPELINE {
        let _ = spare_tx.send(vec![0u8; BLOCK]);
    }
    let hasher = std::thread::Builder::new()
        .name("image-hash".into())
        .spawn(move || {
            let mut hasher = Sha256::new();
            for (block, n) in full_rx {
                hasher.update(&block[..n]);
                if spare_tx.send(block).is_err() {
                    break;
                }
            }
            crate::hex::encode(&hasher.finalize())
        })
        .map_err(store_err)?;
    let mut done = 0u64;
    let mut reported = Instant::now();
    progress(0, total);
    let copied = (|| {
        loop {
            let Ok(mut block) = spare_rx.recv() else {
                return Err(ImageError::store(
                    partial.to_path_buf(),
                    io::Error::other("the hasher stopped"),
                ));
            };
            let n = match reader.read(&mut block) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                    let _ = full_tx.send((block, 0));
                    continue;
                }
                Err(e) => {
                    return Err(ImageError::Source {
                        url: url.into(),
                        permanent: false,
                        why: format!("the download broke off after {done} bytes: {e}"),
                    });
                }
            };
            out.write_all(&block[..n]).map_err(store_err)?;
            done += n as u64;
            if full_tx.send((block, n)).is_err() {
                return Err(ImageError::store(
                    partial.to_path_buf(),
                    io::Error::other("the hasher stopped"),
                ));
            }
            if reported.elapsed() >= PROGRESS_EVERY {
                progress(done, total);
                reported = Instant::now();
            }
        }
    })();
    drop(full_tx);
    let got = hasher.join().unwrap_or_default();
    copied?;
    progress(done, total);
    if let Some(total) = total
        && done != total
    {
        return Err(ImageError::Source {
            url: url.into(),
            permanent: false,
            why: format!("the download ended after {done} of {total} bytes"),
        });
    }
    if got != sha256 {
        return Err(ImageError::Mismatch {
            url: url.into(),
            want: sha256.into(),
            got,
        });
    }
    out.sync_data().map_err(store_err)
}

/// The sha256 of a file, streamed: for checking and for benchmarks.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; BLOCK];
    loop {
        match file.read(&mut buf)? {
            0 => return Ok(crate::hex::encode(&hasher.finalize())),
            n => hasher.update(&buf[..n]),
        }
    }
}
