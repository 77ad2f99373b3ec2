//! Root disks: cloned sparse, grown, never shrunk, replaced atomically.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use eitri_agent::deadline::Deadline;
use eitri_agent::disk::{self, DiskError};
use eitri_agent::error::Failure;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A 64 MiB sparse base with 1 MiB of data at 0 and at 32 MiB.
fn sparse_base(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("base.raw");
    let mut f = File::create(&path).expect("base");
    f.set_len(64 * MIB).expect("size");
    for (at, byte) in [(0, 0xabu8), (32 * MIB, 0xcd)] {
        f.seek(SeekFrom::Start(at)).expect("seek");
        f.write_all(&vec![byte; MIB as usize]).expect("data");
    }
    f.sync_all().expect("sync");
    path
}

fn read_at(path: &Path, at: u64, len: usize) -> Vec<u8> {
    let mut f = File::open(path).expect("open");
    f.seek(SeekFrom::Start(at)).expect("seek");
    let mut buf = vec![0; len];
    f.read_exact(&mut buf).expect("read");
    buf
}

fn leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .expect("list")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with('.'))
        .collect()
}

#[test]
fn disk_is_grown_and_stays_sparse() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = sparse_base(dir.path());
    let dest = dir.path().join("disk.raw");

    disk::prepare(&base, &dest, 1, Deadline::NONE).expect("prepared");

    let meta = fs::metadata(&dest).expect("stat");
    assert_eq!(meta.len(), GIB);
    let allocated = meta.blocks() * 512;
    assert!(
        allocated <= 4 * MIB,
        "only the base's 2 MiB of data is allocated, got {allocated}"
    );
}

#[test]
fn data_and_holes_are_copied_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = sparse_base(dir.path());
    let dest = dir.path().join("disk.raw");

    disk::prepare(&base, &dest, 1, Deadline::NONE).expect("prepared");

    assert_eq!(read_at(&dest, 0, MIB as usize), vec![0xab; MIB as usize]);
    assert_eq!(
        read_at(&dest, 32 * MIB, MIB as usize),
        vec![0xcd; MIB as usize]
    );
    assert_eq!(read_at(&dest, 16 * MIB, 4096), vec![0; 4096]);
    assert_eq!(read_at(&dest, 512 * MIB, 4096), vec![0; 4096]);
}

#[test]
fn a_base_larger_than_the_disk_is_refused_permanently() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().join("big.raw");
    File::create(&base)
        .expect("base")
        .set_len(2 * GIB)
        .expect("size");
    let dest = dir.path().join("disk.raw");

    let err = disk::prepare(&base, &dest, 1, Deadline::NONE).expect_err("would shrink");

    assert!(matches!(err, DiskError::WouldShrink { .. }));
    assert!(err.is_permanent());
    assert!(!dest.exists());
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn an_existing_disk_is_replaced_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = sparse_base(dir.path());
    let dest = dir.path().join("disk.raw");
    OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&dest)
        .expect("old")
        .write_all(b"old disk")
        .expect("write");

    disk::prepare(&base, &dest, 1, Deadline::NONE).expect("prepared");

    assert_eq!(read_at(&dest, 0, 8), vec![0xab; 8]);
    assert!(
        leftovers(dir.path()).is_empty(),
        "{:?}",
        leftovers(dir.path())
    );
}

#[test]
fn an_expired_deadline_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = sparse_base(dir.path());
    let dest = dir.path().join("disk.raw");

    let err = disk::prepare(&base, &dest, 1, Deadline::after(Duration::ZERO)).expect_err("expired");

    assert!(matches!(err, DiskError::Deadline));
    assert!(!dest.exists());
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn the_disk_is_private_to_the_agent() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let base = sparse_base(dir.path());
    let dest = dir.path().join("disk.raw");

    disk::prepare(&base, &dest, 1, Deadline::NONE).expect("prepared");

    assert_eq!(
        fs::metadata(&dest).expect("stat").permissions().mode() & 0o777,
        0o600
    );
}

#[test]
fn a_copy_is_its_sources_size_data_and_holes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let source = sparse_base(dir.path());
    let dest = dir.path().join("memory-ranges");

    disk::copy(&source, &dest, Deadline::NONE).expect("copied");

    let meta = fs::metadata(&dest).expect("stat");
    assert_eq!(meta.len(), 64 * MIB, "not grown");
    assert!(meta.blocks() * 512 <= 4 * MIB, "holes stay holes");
    assert_eq!(
        read_at(&dest, 32 * MIB, MIB as usize),
        vec![0xcd; MIB as usize]
    );
    assert!(
        leftovers(dir.path()).is_empty(),
        "{:?}",
        leftovers(dir.path())
    );
}
