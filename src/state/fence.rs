//! The epoch fence as the state dir keeps it: the highest accepted epoch,
//! and the signed epoch resets obeyed, one file written whole.
//!
//! A signed reset (`epoch_reset`, see the daemon's epoch rule) lowers the
//! fence. It is obeyed only at the fence it names, and at most once: its
//! digest is kept beside the epoch, in the same atomic write that moves
//! the fence, so no crash can leave a reset obeyed but not remembered
//! (replayed once the fence counts back up to where it was made) or
//! remembered but not obeyed (refused when its control plane asks again).
//!
//! `fence.json` is the agent's; `epoch` holds the same epoch alone,
//! written after it, for an agent older than `fence.json` (which reads
//! only `epoch`) and for people. At open `fence.json` wins; a state dir
//! without one (an older agent's) starts from `epoch`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::Layout;
use super::atomic::write_atomic;

/// The format `fence.json` is written in.
const FORMAT: u32 = 1;

/// How many obeyed resets are remembered: resets are rare (a control
/// plane restored from a backup), and each carries its own expiry, past
/// which it is refused anyway.
const REMEMBERED: usize = 64;

/// The fence, as `fence.json` holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    format: u32,
    pub epoch: u64,
    /// The SHA-256 of each signed reset obeyed (its signed bytes), hex,
    /// the newest last.
    #[serde(default)]
    obeyed_resets: Vec<String>,
}

impl Fence {
    /// Whether the reset whose signed bytes have `digest` was obeyed.
    pub fn obeyed(&self, digest: &[u8; 32]) -> bool {
        let hex = crate::hex::encode(digest);
        self.obeyed_resets.contains(&hex)
    }

    /// The fence moved to `epoch` by the reset of `digest`.
    pub fn reset_by(&self, epoch: u64, digest: &[u8; 32]) -> Fence {
        let mut obeyed_resets = self.obeyed_resets.clone();
        obeyed_resets.push(crate::hex::encode(digest));
        let drop = obeyed_resets.len().saturating_sub(REMEMBERED);
        obeyed_resets.drain(..drop);
        Fence {
            format: FORMAT,
            epoch,
            obeyed_resets,
        }
    }

    /// The fence at `epoch`, what it obeyed kept.
    pub fn at(&self, epoch: u64) -> Fence {
        Fence {
            format: FORMAT,
            epoch,
            obeyed_resets: self.obeyed_resets.clone(),
        }
    }

    /// Reads the fence of the state dir at `layout`: `fence.json`, else
    /// (an older agent's state dir) the epoch alone from `epoch`. What
    /// cannot be read counts as epoch 0 and is logged: failing open means
    /// the next snapshot is accepted rather than the host refusing all
    /// work.
    pub fn read(layout: &Layout) -> Fence {
        let path = layout.fence();
        match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Fence>(&bytes) {
                Ok(fence) if fence.format == FORMAT => return fence,
                Ok(fence) => log::warn!(
                    "{} is of format {}, this agent writes {FORMAT}; reading the epoch from {}",
                    path.display(),
                    fence.format,
                    layout.epoch().display()
                ),
                Err(e) => log::warn!(
                    "{} is not a fence ({e}); reading the epoch from {}",
                    path.display(),
                    layout.epoch().display()
                ),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => log::warn!(
                "cannot read {} ({e}); reading the epoch from {}",
                path.display(),
                layout.epoch().display()
            ),
        }
        Fence {
            format: FORMAT,
            epoch: read_epoch(&layout.epoch()),
            obeyed_resets: Vec::new(),
        }
    }

    /// Writes the fence whole, then the epoch alone (see the module).
    pub fn write(&self, layout: &Layout) -> std::io::Result<()> {
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        write_atomic(&layout.fence(), &text)?;
        write_atomic(&layout.epoch(), format!("{}\n", self.epoch).as_bytes())
    }
}

fn read_epoch(path: &Path) -> u64 {
    match std::fs::read_to_string(path) {
        Ok(text) => text.trim().parse().unwrap_or_else(|e| {
            log::warn!(
                "epoch file {} holds {:?} ({e}); starting from epoch 0",
                path.display(),
                text.trim()
            );
            0
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => {
            log::warn!(
                "cannot read epoch file {} ({e}); starting from epoch 0",
                path.display()
            );
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> [u8; 32] {
        [n; 32]
    }

    #[test]
    fn a_reset_is_remembered_with_the_epoch_it_set_in_one_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path());

        Fence::default()
            .at(200)
            .reset_by(100, &digest(1))
            .write(&layout)
            .expect("write");
        let read = Fence::read(&layout);

        assert_eq!(read.epoch, 100);
        assert!(read.obeyed(&digest(1)));
        assert!(!read.obeyed(&digest(2)));
        let legacy = std::fs::read_to_string(layout.epoch()).expect("epoch");
        assert_eq!(legacy, "100\n");
    }

    #[test]
    fn an_older_agents_state_dir_starts_from_its_epoch_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let layout = Layout::new(dir.path());
        std::fs::write(layout.epoch(), "42\n").expect("epoch");

        let read = Fence::read(&layout);

        assert_eq!(read.epoch, 42);
    }

    #[test]
    fn only_the_newest_resets_are_remembered() {
        let fence = (0..=REMEMBERED as u8).fold(Fence::default(), |f, n| f.reset_by(1, &digest(n)));

        assert!(!fence.obeyed(&digest(0)));
        assert!(fence.obeyed(&digest(REMEMBERED as u8)));
    }
}
