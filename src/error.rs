//! What every fallible seam under the engine shares: whether retrying can
//! ever help, and how a chain of errors reads in one line.

use std::error::Error;
use std::fmt;

/// An error from a provisioner or an artifact seam (image, seed, host key).
///
/// Permanence is a property of the error, asked through one method: a
/// permanent error (a checksum mismatch, a disk that would shrink, a missing
/// volume) makes a create terminal at once, because no retry can succeed.
///
/// A host condition is the third kind, beside transient and permanent: the
/// host, not the spec, must change (a missing or too old hypervisor, a
/// path its jailed user cannot reach, a missing piece of confinement). No
/// create attempt is spent on one, the row says what to change on the
/// host, and the create is tried again every tick, so a VM converges by
/// itself once the host is fixed.
pub trait Failure: Error + Send + Sync + 'static {
    fn is_permanent(&self) -> bool {
        false
    }

    fn is_host_condition(&self) -> bool {
        false
    }
}

pub type BoxFailure = Box<dyn Failure>;

/// What a fallible step of a VM's life returns: its value, or a failure
/// that says whether it is permanent (see [`Failure`]).
pub type Outcome<T = ()> = Result<T, BoxFailure>;

impl<F: Failure> From<F> for BoxFailure {
    fn from(f: F) -> BoxFailure {
        Box::new(f)
    }
}

/// A plain failure with a message, for seams with nothing richer to say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Simple {
    pub message: String,
    pub kind: Kind,
}

/// Which of the three kinds a [`Simple`] failure is (see [`Failure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Transient,
    Permanent,
    Host,
}

impl Simple {
    pub fn transient(message: impl Into<String>) -> Simple {
        Simple {
            message: message.into(),
            kind: Kind::Transient,
        }
    }

    pub fn permanent(message: impl Into<String>) -> Simple {
        Simple {
            message: message.into(),
            kind: Kind::Permanent,
        }
    }

    /// A host condition: the host must change before it can pass.
    pub fn host(message: impl Into<String>) -> Simple {
        Simple {
            message: message.into(),
            kind: Kind::Host,
        }
    }
}

impl fmt::Display for Simple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for Simple {}

impl Failure for Simple {
    fn is_permanent(&self) -> bool {
        self.kind == Kind::Permanent
    }

    fn is_host_condition(&self) -> bool {
        self.kind == Kind::Host
    }
}

/// The pass ran out of time. Never permanent: the engine refunds the create
/// attempt of a pass that expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadlineExpired {
    pub waiting_for: &'static str,
}

impl fmt::Display for DeadlineExpired {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the pass deadline passed while {}", self.waiting_for)
    }
}

impl Error for DeadlineExpired {}
impl Failure for DeadlineExpired {}

/// Whether a filesystem being full (ENOSPC) or a quota spent (EDQUOT) is
/// what failed, anywhere in the error's chain. That is a host condition
/// whatever the seam that met it: making room is the operator's to do,
/// and no retry of the VM's create can succeed before.
pub fn out_of_space(err: &(dyn Error + 'static)) -> bool {
    use nix::errno::Errno;
    let full = |errno: i32| matches!(Errno::from_raw(errno), Errno::ENOSPC | Errno::EDQUOT);
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && io.raw_os_error().is_some_and(full)
        {
            return true;
        }
        if let Some(errno) = e.downcast_ref::<Errno>()
            && full(*errno as i32)
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// Renders an error and its sources as one line, `outer: inner: root`,
/// skipping a source whose text the outer message already ends with.
pub fn chain(err: &(dyn Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut next = err.source();
    while let Some(e) = next {
        let text = e.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);
    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("cannot save")
        }
    }
    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn chain_joins_sources() {
        let err = Outer(std::io::Error::other("disk full"));

        assert_eq!(chain(&err), "cannot save: disk full");
    }

    #[test]
    fn simple_errors_carry_their_kind() {
        assert!(Simple::permanent("x").is_permanent());
        assert!(!Simple::transient("x").is_permanent());
        assert!(Simple::host("x").is_host_condition());
        assert!(!Simple::host("x").is_permanent());
    }

    #[test]
    fn a_full_filesystem_under_a_wrapper_is_out_of_space() {
        let err = Outer(std::io::Error::from_raw_os_error(nix::libc::ENOSPC));

        assert!(out_of_space(&err));
    }

    #[test]
    fn a_spent_quota_is_out_of_space() {
        assert!(out_of_space(&nix::errno::Errno::EDQUOT));
    }

    #[test]
    fn another_io_error_is_not_out_of_space() {
        let err = Outer(std::io::Error::from_raw_os_error(nix::libc::EIO));

        assert!(!out_of_space(&err));
    }
}
