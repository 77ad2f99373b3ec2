//! The guest's side of one exchange: read a request, check it, do what it
//! asks through [`Inside`], write the answer. Used by `eitri-guest` with the
//! real guest ([`super::inside`]) and by the stand-in hypervisor with a
//! scripted one.
//!
//! What the host may ask is this list and nothing more: no command, no
//! file of the host's choosing, no transfer. A request that is garbled, of
//! another version or out of bounds is answered with a [`Failure`] and
//! changes nothing.

use std::time::{Duration, SystemTime};

use crate::deadline::Deadline;
use crate::pb::guest::{
    Answer, Failure, Frozen, Identity, IdentityApplied, PoweringOff, Quieted, Request, Reseeded,
    Resumed, Status, Thawed, answer, request,
};

use super::frame::{self, Channel, FrameError};

/// The fewest and most entropy bytes a reseed carries.
pub const ENTROPY_BYTES: std::ops::RangeInclusive<usize> = 32..=512;
/// The longest a guest stays frozen, whatever the host asks.
pub const MAX_FREEZE: Duration = Duration::from_secs(600);

/// What a guest can be asked to do, as the guest does it.
pub trait Inside {
    fn status(&self) -> Status;
    /// Credits `r.entropy`, reseeds, checks the clock against the host's
    /// (`received` is when the request was read), renews leases.
    fn resumed(&self, r: &Resumed, received: SystemTime) -> Result<Reseeded, String>;
    fn identity(&self, i: &Identity) -> Result<IdentityApplied, String>;
    /// Freezes the writable filesystems, and arranges their thaw after
    /// `thaw_after` whatever happens next.
    fn freeze(&self, thaw_after: Duration) -> Result<Vec<String>, String>;
    fn thaw(&self) -> Result<Vec<String>, String>;
    /// Readies the guest for a save: quiets what its resume would report
    /// falsely, until it has run again (see `Saving` in the protocol).
    fn saving(&self) -> Result<Quieted, String>;
    /// Powers the guest off; called once the answer is written.
    fn power_off(&self);
}

fn failure(id: u64, message: String) -> Answer {
    Answer {
        version: super::VERSION,
        id,
        said: Some(answer::Said::Failure(Failure {
            message,
            versions: vec![super::VERSION],
        })),
    }
}

/// The answer to `request`, and whether the guest powers off after it.
fn answer(request: Request, inside: &dyn Inside, received: SystemTime) -> (Answer, bool) {
    let id = request.id;
    if request.version != super::VERSION {
        let words = format!(
            "this guest agent speaks protocol version {}, not {}",
            super::VERSION,
            request.version
        );
        return (failure(id, words), false);
    }
    let said = match request.ask {
        None => Err("the request asks for nothing".to_owned()),
        Some(request::Ask::Status(_)) => Ok(answer::Said::Status(inside.status())),
        Some(request::Ask::Resumed(r)) => {
            if ENTROPY_BYTES.contains(&r.entropy.len()) {
                inside.resumed(&r, received).map(answer::Said::Reseeded)
            } else {
                Err(format!(
                    "a reseed carries {} to {} bytes, not {}",
                    ENTROPY_BYTES.start(),
                    ENTROPY_BYTES.end(),
                    r.entropy.len()
                ))
            }
        }
        Some(request::Ask::Identity(i)) if i.nics.len() > super::said::MAX_NICS => Err(format!(
            "an identity gives at most {} NICs another MAC, not {}",
            super::said::MAX_NICS,
            i.nics.len()
        )),
        Some(request::Ask::Identity(i)) => inside.identity(&i).map(answer::Said::Identity),
        Some(request::Ask::Freeze(f)) => {
            let thaw_after = Duration::from_millis(u64::from(f.thaw_after_ms)).min(MAX_FREEZE);
            inside.freeze(thaw_after).map(|mounts| {
                answer::Said::Frozen(Frozen {
                    mounts,
                    thaw_after_ms: u32::try_from(thaw_after.as_millis()).unwrap_or(u32::MAX),
                })
            })
        }
        Some(request::Ask::Thaw(_)) => inside
            .thaw()
            .map(|mounts| answer::Said::Thawed(Thawed { mounts })),
        Some(request::Ask::PowerOff(_)) => Ok(answer::Said::PoweringOff(PoweringOff {})),
        Some(request::Ask::Saving(_)) => inside.saving().map(answer::Said::Quieted),
    };
    let off = matches!(said, Ok(answer::Said::PoweringOff(_)));
    match said {
        Ok(said) => (
            Answer {
                version: super::VERSION,
                id,
                said: Some(said),
            },
            off,
        ),
        Err(words) => (failure(id, words), false),
    }
}

/// Serves one exchange on `stream` before `deadline`.
pub fn serve_one(
    stream: &mut impl Channel,
    inside: &dyn Inside,
    deadline: Deadline,
) -> Result<(), FrameError> {
    use prost::Message;
    let bytes = frame::read(stream, super::MAX_REQUEST, deadline)?;
    let received = SystemTime::now();
    let (answer, off) = match Request::decode(bytes.as_slice()) {
        Ok(request) => answer(request, inside, received),
        Err(e) => (failure(0, format!("not a request: {e}")), false),
    };
    frame::write(stream, &answer.encode_to_vec(), deadline)?;
    if off {
        inside.power_off();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::guest::{Freeze, PowerOff, Thaw};
    use prost::Message;
    use std::cell::Cell;
    use std::os::unix::net::UnixStream;

    /// A guest that counts what it is asked to do.
    #[derive(Default)]
    struct Counted {
        done: Cell<u32>,
        froze_for: Cell<Duration>,
    }

    impl Inside for Counted {
        fn status(&self) -> Status {
            self.done.set(self.done.get() + 1);
            Status::default()
        }
        fn resumed(&self, _: &Resumed, _: SystemTime) -> Result<Reseeded, String> {
            self.done.set(self.done.get() + 1);
            Ok(Reseeded::default())
        }
        fn identity(&self, _: &Identity) -> Result<IdentityApplied, String> {
            self.done.set(self.done.get() + 1);
            Ok(IdentityApplied::default())
        }
        fn freeze(&self, thaw_after: Duration) -> Result<Vec<String>, String> {
            self.done.set(self.done.get() + 1);
            self.froze_for.set(thaw_after);
            Ok(vec![])
        }
        fn thaw(&self) -> Result<Vec<String>, String> {
            self.done.set(self.done.get() + 1);
            Ok(vec![])
        }
        fn saving(&self) -> Result<Quieted, String> {
            self.done.set(self.done.get() + 1);
            Ok(Quieted::default())
        }
        fn power_off(&self) {
            self.done.set(self.done.get() + 1);
        }
    }

    /// `request` served by `inside`: the answer.
    fn served(request: &Request, inside: &Counted) -> Answer {
        let (mut host, mut guest) = UnixStream::pair().expect("pair");
        let deadline = Deadline::after(Duration::from_secs(5));
        frame::write(&mut host, &request.encode_to_vec(), deadline).expect("write");
        serve_one(&mut guest, inside, deadline).expect("served");
        let bytes = frame::read(&mut host, super::super::MAX_ANSWER, deadline).expect("read");
        Answer::decode(bytes.as_slice()).expect("an answer")
    }

    fn asking(version: u32, ask: request::Ask) -> Request {
        Request {
            version,
            id: 9,
            ask: Some(ask),
        }
    }

    #[test]
    fn a_request_of_another_version_does_nothing_and_names_the_versions_spoken() {
        let inside = Counted::default();

        let answer = served(&asking(2, request::Ask::Thaw(Thaw {})), &inside);

        let Some(answer::Said::Failure(f)) = answer.said else {
            panic!("{answer:?}")
        };
        assert_eq!((f.versions, inside.done.get()), (vec![1], 0));
    }

    #[test]
    fn a_reseed_with_too_little_entropy_does_nothing() {
        let inside = Counted::default();
        let reseed = Resumed {
            entropy: vec![7; 8],
            ..Resumed::default()
        };

        let answer = served(&asking(1, request::Ask::Resumed(reseed)), &inside);

        assert!(
            matches!(answer.said, Some(answer::Said::Failure(_))),
            "{answer:?}"
        );
        assert_eq!(inside.done.get(), 0);
    }

    #[test]
    fn a_freeze_is_never_longer_than_the_guests_own_bound() {
        let inside = Counted::default();
        let forever = Freeze {
            thaw_after_ms: u32::MAX,
        };

        let answer = served(&asking(1, request::Ask::Freeze(forever)), &inside);

        assert_eq!(inside.froze_for.get(), MAX_FREEZE);
        let Some(answer::Said::Frozen(f)) = answer.said else {
            panic!("{answer:?}")
        };
        assert_eq!(u64::from(f.thaw_after_ms), MAX_FREEZE.as_millis() as u64);
    }

    #[test]
    fn power_off_is_done_after_its_answer_is_written() {
        let inside = Counted::default();

        let answer = served(&asking(1, request::Ask::PowerOff(PowerOff {})), &inside);

        assert!(matches!(answer.said, Some(answer::Said::PoweringOff(_))));
        assert_eq!(inside.done.get(), 1);
    }
}
