//! What a guest said, checked: an [`Answer`] becomes a [`Said`] only if it
//! is of this version, answers the request's id with the kind of answer the
//! request asked for, and every string in it is short and printable. The
//! guest is the tenant's code; what passes here is still only its report,
//! shown quoted and never acted upon as a path, a command or a size.

use std::fmt;

use crate::pb::guest::{Answer, answer, request};

/// The longest string the host keeps from a guest.
const MAX_TEXT: usize = 256;
/// The most mount points a freeze or thaw may report.
const MAX_MOUNTS: usize = 64;
/// The most NICs a guest is asked to give another MAC, and may answer.
pub const MAX_NICS: usize = 8;
/// How many of an answer's timed steps are read, and how long a name.
const MAX_STEPS: usize = 16;
const MAX_STEP_NAME: usize = 32;

/// What the guest said its system is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SystemState {
    Unknown,
    Starting,
    Up,
    Degraded,
    Stopping,
}

impl SystemState {
    fn of(raw: i32) -> SystemState {
        use crate::pb::guest::SystemState as Pb;
        match Pb::try_from(raw) {
            Ok(Pb::SystemStarting) => SystemState::Starting,
            Ok(Pb::SystemUp) => SystemState::Up,
            Ok(Pb::SystemDegraded) => SystemState::Degraded,
            Ok(Pb::SystemStopping) => SystemState::Stopping,
            Ok(Pb::SystemUnknown) | Err(_) => SystemState::Unknown,
        }
    }

    /// Whether a VM in this state is up for its users (a degraded system
    /// still runs: a failed unit is the tenant's to see).
    pub fn is_up(self) -> bool {
        matches!(self, SystemState::Up | SystemState::Degraded)
    }
}

impl fmt::Display for SystemState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SystemState::Unknown => "unknown",
            SystemState::Starting => "starting",
            SystemState::Up => "up",
            SystemState::Degraded => "degraded",
            SystemState::Stopping => "stopping",
        })
    }
}

/// A guest's status, as it said it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub boot_id: String,
    pub uptime_ms: u64,
    pub system: SystemState,
    pub system_detail: String,
    pub memory_total_kib: u64,
    pub memory_available_kib: u64,
    pub load_milli: u32,
    pub root_total_bytes: u64,
    pub root_free_bytes: u64,
    pub agent_version: String,
}

/// What a guest said it did after a resume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reseeded {
    pub credited_bytes: u32,
    pub crng_reseeded: bool,
    pub clock_offset_ms: i64,
    pub clock_set: bool,
    pub lease_renewed: bool,
}

/// An answer that passed the checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Said {
    Status(Status),
    Reseeded(Reseeded),
    Identity {
        hostname: String,
        ssh_host_key_fingerprint: String,
        sshd_reloaded: bool,
        authorized_keys: u32,
        /// The MACs its interfaces have now, of those it was asked to
        /// change.
        macs: Vec<crate::model::Mac>,
        /// Each interface it moved to a new MAC took a new address.
        readdressed: bool,
        /// How long each step took in the guest, as it says: for the
        /// log only (see [`steps`]).
        steps: Vec<(String, std::time::Duration)>,
        /// Its status, taken alongside the identity's last steps; `None`
        /// from an agent that sends none.
        status: Option<Status>,
    },
    Frozen {
        mounts: Vec<String>,
        thaw_after_ms: u32,
    },
    Thawed {
        mounts: Vec<String>,
    },
    PoweringOff,
    /// Ready to be saved: whether its kernel's stall check is quiet now,
    /// and whether it was before it was asked.
    Quieted {
        stall_check_quiet: bool,
        was_quiet: bool,
    },
}

/// Why an answer was not taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaidError {
    /// Not a protobuf `Answer`.
    Garbled(String),
    /// Another version than this build speaks.
    Version(u32),
    /// The answer to another request.
    OtherId {
        asked: u64,
        said: u64,
    },
    /// Another kind of answer than the request asked for (or none).
    OtherKind {
        asked: &'static str,
        said: &'static str,
    },
    /// A string that is too long or holds control characters.
    BadText {
        field: &'static str,
    },
    TooManyMounts(usize),
    /// More MACs than a VM has NICs, or one that is no MAC.
    BadMacs,
    /// The guest said it could not (its words, quoted).
    Refused(String),
}

impl fmt::Display for SaidError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SaidError::Garbled(e) => write!(f, "answered something that is not an answer ({e})"),
            SaidError::Version(v) => write!(
                f,
                "answered in protocol version {v}; this agent speaks {} (update the guest agent)",
                super::VERSION
            ),
            SaidError::OtherId { asked, said } => {
                write!(f, "answered request {said} when asked request {asked}")
            }
            SaidError::OtherKind { asked, said } => {
                write!(f, "answered {said} when asked for {asked}")
            }
            SaidError::BadText { field } => write!(
                f,
                "answered a {field} longer than {MAX_TEXT} bytes or with control characters"
            ),
            SaidError::TooManyMounts(n) => {
                write!(f, "named {n} mounts, over the {MAX_MOUNTS} allowed")
            }
            SaidError::BadMacs => write!(
                f,
                "answered more than {MAX_NICS} MACs, or something that is no MAC"
            ),
            SaidError::Refused(words) => write!(f, "could not: {}", crate::quote::text(words)),
        }
    }
}

impl std::error::Error for SaidError {}

/// The name of what a request asks for, as errors say it.
pub fn asked_name(ask: &request::Ask) -> &'static str {
    match ask {
        request::Ask::Status(_) => "a status",
        request::Ask::Resumed(_) => "a reseed",
        request::Ask::Identity(_) => "an identity",
        request::Ask::Freeze(_) => "a freeze",
        request::Ask::Thaw(_) => "a thaw",
        request::Ask::PowerOff(_) => "a power off",
        request::Ask::Saving(_) => "a save's warning",
    }
}

fn said_name(said: Option<&answer::Said>) -> &'static str {
    match said {
        None => "nothing",
        Some(answer::Said::Status(_)) => "a status",
        Some(answer::Said::Reseeded(_)) => "a reseed",
        Some(answer::Said::Identity(_)) => "an identity",
        Some(answer::Said::Frozen(_)) => "a freeze",
        Some(answer::Said::Thawed(_)) => "a thaw",
        Some(answer::Said::PoweringOff(_)) => "a power off",
        Some(answer::Said::Quieted(_)) => "a save's warning",
        Some(answer::Said::Failure(_)) => "a failure",
    }
}

/// `raw`, if it is short and has no control characters.
fn text(raw: String, field: &'static str) -> Result<String, SaidError> {
    if raw.len() > MAX_TEXT || raw.chars().any(char::is_control) {
        return Err(SaidError::BadText { field });
    }
    Ok(raw)
}

fn mounts(raw: Vec<String>) -> Result<Vec<String>, SaidError> {
    if raw.len() > MAX_MOUNTS {
        return Err(SaidError::TooManyMounts(raw.len()));
    }
    raw.into_iter().map(|m| text(m, "mount point")).collect()
}

/// The steps a guest says it took, for a log line: the first
/// [`MAX_STEPS`], each named in a few plain words (one that is not is
/// left out). Nothing is decided on them, so what a guest says wrongly
/// here fails nothing.
fn steps(raw: Vec<crate::pb::guest::StepTook>) -> Vec<(String, std::time::Duration)> {
    raw.into_iter()
        .take(MAX_STEPS)
        .filter(|s| {
            s.step.len() <= MAX_STEP_NAME
                && s.step
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == ' ')
        })
        .map(|s| {
            (
                s.step,
                std::time::Duration::from_micros(u64::from(s.micros)),
            )
        })
        .collect()
}

/// The MACs a guest says its interfaces have, each one.
fn macs(raw: &[String]) -> Result<Vec<crate::model::Mac>, SaidError> {
    if raw.len() > MAX_NICS {
        return Err(SaidError::BadMacs);
    }
    raw.iter()
        .map(|m| crate::model::Mac::parse(m).ok_or(SaidError::BadMacs))
        .collect()
}

/// A status as the guest said it, its words checked as any answer's.
fn status(s: crate::pb::guest::Status) -> Result<Status, SaidError> {
    Ok(Status {
        boot_id: text(s.boot_id, "boot id")?,
        uptime_ms: s.uptime_ms,
        system: SystemState::of(s.system),
        system_detail: text(s.system_detail, "system state")?,
        memory_total_kib: s.memory_total_kib,
        memory_available_kib: s.memory_available_kib,
        load_milli: s.load_milli,
        root_total_bytes: s.root_total_bytes,
        root_free_bytes: s.root_free_bytes,
        agent_version: text(s.agent_version, "agent version")?,
    })
}

/// Checks the bytes a guest answered request `id`, which asked `ask`.
pub fn check(bytes: &[u8], id: u64, ask: &request::Ask) -> Result<Said, SaidError> {
    use prost::Message;
    let answer = Answer::decode(bytes).map_err(|e| SaidError::Garbled(e.to_string()))?;
    if answer.version != super::VERSION {
        return Err(SaidError::Version(answer.version));
    }
    if answer.id != id {
        return Err(SaidError::OtherId {
            asked: id,
            said: answer.id,
        });
    }
    let asked = asked_name(ask);
    let other = |said: &Option<answer::Said>| SaidError::OtherKind {
        asked,
        said: said_name(said.as_ref()),
    };
    match (ask, answer.said) {
        (_, Some(answer::Said::Failure(f))) => {
            let mut words = f.message;
            let mut cut = words.len().min(MAX_TEXT);
            while !words.is_char_boundary(cut) {
                cut -= 1;
            }
            words.truncate(cut);
            Err(SaidError::Refused(words))
        }
        (request::Ask::Status(_), Some(answer::Said::Status(s))) => Ok(Said::Status(status(s)?)),
        (request::Ask::Resumed(_), Some(answer::Said::Reseeded(r))) => {
            Ok(Said::Reseeded(Reseeded {
                credited_bytes: r.credited_bytes,
                crng_reseeded: r.crng_reseeded,
                clock_offset_ms: r.clock_offset_ms,
                clock_set: r.clock_set,
                lease_renewed: r.lease_renewed,
            }))
        }
        (request::Ask::Identity(_), Some(answer::Said::Identity(i))) => Ok(Said::Identity {
            hostname: text(i.hostname, "hostname")?,
            ssh_host_key_fingerprint: text(i.ssh_host_key_fingerprint, "host key fingerprint")?,
            sshd_reloaded: i.sshd_reloaded,
            authorized_keys: i.authorized_keys,
            macs: macs(&i.macs)?,
            readdressed: i.readdressed,
            steps: steps(i.steps),
            status: i.status.map(status).transpose()?,
        }),
        (request::Ask::Freeze(_), Some(answer::Said::Frozen(f))) => Ok(Said::Frozen {
            mounts: mounts(f.mounts)?,
            thaw_after_ms: f.thaw_after_ms,
        }),
        (request::Ask::Thaw(_), Some(answer::Said::Thawed(t))) => Ok(Said::Thawed {
            mounts: mounts(t.mounts)?,
        }),
        (request::Ask::PowerOff(_), Some(answer::Said::PoweringOff(_))) => Ok(Said::PoweringOff),
        (request::Ask::Saving(_), Some(answer::Said::Quieted(q))) => Ok(Said::Quieted {
            stall_check_quiet: q.stall_check_quiet,
            was_quiet: q.was_quiet,
        }),
        (_, said) => Err(other(&said)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::guest::{Failure, StatusAsk, Thawed};
    use prost::Message;

    fn status_ask() -> request::Ask {
        request::Ask::Status(StatusAsk {})
    }

    fn encoded(answer: &Answer) -> Vec<u8> {
        answer.encode_to_vec()
    }

    fn status(boot_id: &str) -> Answer {
        Answer {
            version: super::super::VERSION,
            id: 7,
            said: Some(answer::Said::Status(crate::pb::guest::Status {
                boot_id: boot_id.into(),
                system: crate::pb::guest::SystemState::SystemUp as i32,
                ..Default::default()
            })),
        }
    }

    #[test]
    fn a_status_answer_is_taken() {
        let said = check(&encoded(&status("b1")), 7, &status_ask());
        let Ok(Said::Status(s)) = said else {
            panic!("{said:?}")
        };
        assert_eq!((s.boot_id.as_str(), s.system), ("b1", SystemState::Up));
    }

    #[test]
    fn an_identitys_steps_are_read_and_a_badly_named_one_left_out() {
        let step = |name: &str, micros| crate::pb::guest::StepTook {
            step: name.into(),
            micros,
        };
        let answer = Answer {
            version: super::super::VERSION,
            id: 7,
            said: Some(answer::Said::Identity(crate::pb::guest::IdentityApplied {
                hostname: "web-1".into(),
                steps: vec![
                    step("host key", 2_500),
                    step("sync\n\x1b[2J", 1),
                    step(&"x".repeat(MAX_STEP_NAME + 1), 1),
                    step("leases", 40_000),
                ],
                ..Default::default()
            })),
        };
        let ask = request::Ask::Identity(crate::pb::guest::Identity::default());

        let said = check(&encoded(&answer), 7, &ask);

        let Ok(Said::Identity { steps, .. }) = said else {
            panic!("{said:?}")
        };
        assert_eq!(
            steps,
            vec![
                (
                    "host key".to_owned(),
                    std::time::Duration::from_micros(2_500)
                ),
                ("leases".to_owned(), std::time::Duration::from_millis(40)),
            ]
        );
    }

    /// What request 7, an identity, is answered with `status` beside it.
    fn identity_with(status: crate::pb::guest::Status) -> Result<Said, SaidError> {
        let answer = Answer {
            version: super::super::VERSION,
            id: 7,
            said: Some(answer::Said::Identity(crate::pb::guest::IdentityApplied {
                hostname: "web-1".into(),
                status: Some(status),
                ..Default::default()
            })),
        };
        let ask = request::Ask::Identity(crate::pb::guest::Identity::default());
        check(&encoded(&answer), 7, &ask)
    }

    #[test]
    fn an_identitys_status_is_read_as_a_status_answer_is() {
        let status = crate::pb::guest::Status {
            system: crate::pb::guest::SystemState::SystemUp as i32,
            system_detail: "systemd: running".into(),
            memory_total_kib: 512 << 10,
            ..Default::default()
        };

        let said = identity_with(status);

        let Ok(Said::Identity {
            status: Some(status),
            ..
        }) = said
        else {
            panic!("{said:?}")
        };
        assert_eq!(status.system, SystemState::Up);
        assert_eq!(status.system_detail, "systemd: running");
        assert_eq!(status.memory_total_kib, 512 << 10);
    }

    #[test]
    fn an_identity_whose_status_fails_the_checks_is_not_taken() {
        let status = crate::pb::guest::Status {
            system_detail: "x".repeat(MAX_TEXT + 1),
            ..Default::default()
        };

        let said = identity_with(status);

        assert!(said.is_err(), "{said:?}");
    }

    #[test]
    fn an_identity_says_no_more_steps_than_are_read() {
        let answer = Answer {
            version: super::super::VERSION,
            id: 7,
            said: Some(answer::Said::Identity(crate::pb::guest::IdentityApplied {
                steps: (0..1000)
                    .map(|_| crate::pb::guest::StepTook {
                        step: "sync".into(),
                        micros: 1,
                    })
                    .collect(),
                ..Default::default()
            })),
        };
        let ask = request::Ask::Identity(crate::pb::guest::Identity::default());

        let said = check(&encoded(&answer), 7, &ask);

        let Ok(Said::Identity { steps, .. }) = said else {
            panic!("{said:?}")
        };
        assert_eq!(steps.len(), MAX_STEPS);
    }

    #[test]
    fn an_answer_of_another_version_is_refused() {
        let mut answer = status("b1");
        answer.version = 2;
        assert_eq!(
            check(&encoded(&answer), 7, &status_ask()),
            Err(SaidError::Version(2))
        );
    }

    #[test]
    fn an_answer_to_another_request_is_refused() {
        assert_eq!(
            check(&encoded(&status("b1")), 8, &status_ask()),
            Err(SaidError::OtherId { asked: 8, said: 7 })
        );
    }

    #[test]
    fn an_answer_of_another_kind_is_refused() {
        let answer = Answer {
            version: super::super::VERSION,
            id: 7,
            said: Some(answer::Said::Thawed(Thawed { mounts: vec![] })),
        };
        assert_eq!(
            check(&encoded(&answer), 7, &status_ask()),
            Err(SaidError::OtherKind {
                asked: "a status",
                said: "a thaw"
            })
        );
    }

    #[test]
    fn text_with_a_control_character_is_refused() {
        assert_eq!(
            check(&encoded(&status("b1\n[ERROR] forged")), 7, &status_ask()),
            Err(SaidError::BadText { field: "boot id" })
        );
    }

    #[test]
    fn a_failure_is_cut_and_quoted() {
        let answer = Answer {
            version: super::super::VERSION,
            id: 7,
            said: Some(answer::Said::Failure(Failure {
                message: "é".repeat(1000),
                versions: vec![],
            })),
        };
        let Err(SaidError::Refused(words)) = check(&encoded(&answer), 7, &status_ask()) else {
            panic!("not refused")
        };
        assert!(words.len() <= MAX_TEXT, "{}", words.len());
    }

    #[test]
    fn bytes_that_are_not_an_answer_are_refused() {
        assert!(matches!(
            check(&[0xff; 40], 7, &status_ask()),
            Err(SaidError::Garbled(_))
        ));
    }

    /// Whatever bytes a guest answers, the check ends without a panic, and
    /// what it takes holds only bounded, printable text.
    #[test]
    fn random_and_mutated_answers_never_pass_unbounded_text() {
        // Seeded: a failure reproduces.
        let mut rng = crate::rng::XorShift::from_seed(0x9e37_79b9_7f4a_7c15);
        let valid = encoded(&status("b1"));
        let asks = [
            status_ask(),
            request::Ask::Thaw(crate::pb::guest::Thaw {}),
            request::Ask::Freeze(crate::pb::guest::Freeze { thaw_after_ms: 1 }),
        ];
        for round in 0..20_000 {
            let bytes: Vec<u8> = if round % 2 == 0 {
                let len = (rng.next_u64() % 300) as usize;
                (0..len).map(|_| rng.next_u64() as u8).collect()
            } else {
                let mut b = valid.clone();
                for _ in 0..=(rng.next_u64() % 4) {
                    let at = (rng.next_u64() as usize) % b.len();
                    b[at] = rng.next_u64() as u8;
                }
                b
            };
            let ask = &asks[round % asks.len()];
            if let Ok(said) = check(&bytes, 7, ask) {
                let texts: Vec<String> = match said {
                    Said::Status(s) => vec![s.boot_id, s.system_detail, s.agent_version],
                    Said::Frozen { mounts, .. } | Said::Thawed { mounts } => mounts,
                    other => panic!("{other:?} answers none of the requests asked"),
                };
                for t in texts {
                    assert!(
                        t.len() <= MAX_TEXT && !t.chars().any(char::is_control),
                        "{t:?}"
                    );
                }
            }
        }
    }
}
