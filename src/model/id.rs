//! Identifiers that arrive from the wire and end up naming files.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The longest id accepted. Bounded so a path built from it stays far below
/// PATH_MAX and a tap or socket name derived from it can be made to fit.
pub const MAX_ID_LEN: usize = 64;

/// A VM or volume id: 1–64 characters of `[A-Za-z0-9._-]`, starting with a
/// letter, digit or `_`.
///
/// The only way to get one is [`Id::parse`] (serde goes through it too), so a
/// value of this type is always safe as a single path component: it has no
/// `/`, cannot climb with `..`, and cannot be empty. The first character is
/// narrower than the rest on purpose: a leading `.` would make a hidden file
/// that collides with the store's own temp and marker names, and a leading
/// `-` reads as a flag on any command line an id ends up in.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Id(String);

impl Id {
    pub fn parse(raw: &str) -> Result<Id, IdError> {
        let problem = if raw.is_empty() {
            Some("it is empty")
        } else if raw.len() > MAX_ID_LEN {
            Some("it is longer than 64 characters")
        } else if raw == "." || raw == ".." {
            Some("it names a directory")
        } else if raw.starts_with(['.', '-']) {
            Some("it starts with . or -")
        } else if !raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            Some("it has a character outside A-Z a-z 0-9 . _ -")
        } else {
            None
        };
        match problem {
            None => Ok(Id(raw.to_owned())),
            Some(problem) => Err(IdError {
                shown: crate::quote::text(raw),
                problem,
            }),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl TryFrom<String> for Id {
    type Error = IdError;
    fn try_from(raw: String) -> Result<Id, IdError> {
        Id::parse(&raw)
    }
}

impl From<Id> for String {
    fn from(id: Id) -> String {
        id.0
    }
}

/// Why a string is not an [`Id`]. Carries a printable, bounded rendering of
/// the offending value: it came from the network and goes into logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdError {
    shown: String,
    problem: &'static str,
}

impl fmt::Display for IdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "id {} is refused because {}; ids are 1-64 characters of A-Z a-z 0-9 . _ - that start with a letter, digit or _",
            self.shown, self.problem
        )
    }
}

impl std::error::Error for IdError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet() {
        let id = Id::parse("vm-01.a_B").expect("valid id");
        assert_eq!(id.as_str(), "vm-01.a_B");
    }

    #[test]
    fn refuses_path_climbing_and_separators() {
        for raw in [
            "../x", "a/b", "..", ".", "/abs", "a\\b", "x\0y", ".hidden", "-rf",
        ] {
            assert!(Id::parse(raw).is_err(), "{raw:?} must be refused");
        }
    }

    #[test]
    fn refuses_empty() {
        let err = Id::parse("").expect_err("empty id");
        assert!(err.to_string().contains("empty"), "{err}");
    }

    #[test]
    fn length_is_bounded_at_64() {
        assert!(Id::parse(&"a".repeat(64)).is_ok());
        let err = Id::parse(&"a".repeat(65)).expect_err("65 chars");
        assert!(err.to_string().contains("longer than 64"), "{err}");
    }

    #[test]
    fn deserializing_validates() {
        let parsed: Result<Id, _> = serde_json::from_str("\"../etc\"");
        assert!(parsed.is_err());
    }

    #[test]
    fn error_quotes_control_characters() {
        let err = Id::parse("a\nb").expect_err("newline");
        assert!(err.to_string().contains("\"a\\nb\""), "{err}");
    }
}
