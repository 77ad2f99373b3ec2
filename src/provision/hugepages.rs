//! Guest memory on 2 MiB huge pages (`--guest-hugepages`): the host's
//! reserved pool of them, as the kernel counts it in sysfs.
//!
//! Why a host would: a resumed guest faults its memory in from the
//! snapshot on first touch, one fault per page. On 2 MiB pages a wake
//! takes a few dozen faults where 4 KiB pages take thousands, and the
//! guest answers its first packet that much sooner (`make bench-wake`).
//! The price is the pool: huge pages are set aside by the operator
//! (`sysctl vm.nr_hugepages`), used by nothing else, and a guest on them
//! can use no other memory, so the pool is what the host can commit.
//!
//! A pool page is free until it is mapped: a VMM reserves its guest's
//! pages when it maps them at boot (so a pool too small fails the boot,
//! never a running guest), and faults them in later. What another VM may
//! still have is the free pages less those reserved.

use std::fs;
use std::io;
use std::path::Path;

/// The size of each page, in MiB.
pub const PAGE_MB: u64 = 2;

/// The kernel's counts of the 2 MiB pool.
const POOL_DIR: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

/// The 2 MiB pool, in pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool {
    /// Pages set aside (`nr_hugepages`).
    pub total: u64,
    /// Pages neither in use nor reserved by a mapping.
    pub available: u64,
}

impl Pool {
    /// This host's pool; an error when the kernel has no 2 MiB pool.
    pub fn of_host() -> io::Result<Pool> {
        Pool::read_in(Path::new(POOL_DIR))
    }

    fn read_in(dir: &Path) -> io::Result<Pool> {
        let count = |name: &str| -> io::Result<u64> {
            let text = fs::read_to_string(dir.join(name))?;
            text.trim().parse().map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: {text:?} is not a count", dir.join(name).display()),
                )
            })
        };
        let free = count("free_hugepages")?;
        let reserved = count("resv_hugepages")?;
        Ok(Pool {
            total: count("nr_hugepages")?,
            available: free.saturating_sub(reserved),
        })
    }

    /// The pool's size in MiB.
    pub fn total_mb(&self) -> u64 {
        self.total * PAGE_MB
    }
}

/// The pages a guest of `mem_mb` takes; `None` when that is not a whole
/// number of them (cloud-hypervisor refuses such a size).
pub fn pages_for(mem_mb: u64) -> Option<u64> {
    mem_mb.is_multiple_of(PAGE_MB).then_some(mem_mb / PAGE_MB)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_dir(nr: &str, free: &str, resv: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, v) in [
            ("nr_hugepages", nr),
            ("free_hugepages", free),
            ("resv_hugepages", resv),
        ] {
            fs::write(dir.path().join(name), format!("{v}\n")).expect("write");
        }
        dir
    }

    #[test]
    fn pages_reserved_by_a_mapping_are_not_available() {
        let dir = pool_dir("600", "400", "150");

        let pool = Pool::read_in(dir.path()).expect("read");

        assert_eq!(
            pool,
            Pool {
                total: 600,
                available: 250
            }
        );
        assert_eq!(pool.total_mb(), 1200);
    }

    #[test]
    fn a_count_that_is_no_number_is_an_error_naming_its_file() {
        let dir = pool_dir("600", "lots", "0");

        let e = Pool::read_in(dir.path()).expect_err("refused");

        assert!(e.to_string().contains("free_hugepages"), "{e}");
    }

    #[test]
    fn a_guest_takes_whole_pages_only() {
        assert_eq!(pages_for(512), Some(256));
        assert_eq!(pages_for(513), None);
    }
}
