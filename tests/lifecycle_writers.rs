//! Only the lifecycle's named transitions write a record's lifecycle
//! fields (see `src/reconcile/lifecycle.rs`): a pass that set
//! `stop_requested` or `last_error` by hand would bring back the field
//! combinations, spread over files, that let two reports of one VM
//! disagree. Checked over the source: an assignment to one of those fields
//! anywhere else fails this test. (A report row's own `last_error`, on a
//! value called `row`, is not a record's.)

const FIELDS: &[&str] = &[
    "create_attempts",
    "created_at",
    "last_error",
    "failed_at",
    "failure_permanent",
    "boot_id",
    "stop_requested",
    "quarantined_at",
    "quarantine_tombstoned",
];

/// Where the fields may be written: the transitions, the record's own
/// definition, and the fakes (which build records for tests).
const ALLOWED: &[&str] = &["reconcile/lifecycle.rs", "state/record.rs", "testkit/"];

/// `receiver.field =`, `+=`, `-=`, or `.clear()`/`.clone_from(`/`.push_str(`
/// on it, outside comments; `row.last_error` (a report row) is not a record.
fn writes(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        for field in FIELDS {
            let needle = format!(".{field}");
            for (at, _) in code.match_indices(&needle) {
                let receiver: String = code[..at]
                    .chars()
                    .rev()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect();
                let rest = code[at + needle.len()..].trim_start();
                let after_name = code[at + needle.len()..].chars().next();
                if after_name.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                    continue; // a longer name
                }
                let assigns = (rest.starts_with('=') && !rest.starts_with("=="))
                    || rest.starts_with("+=")
                    || rest.starts_with("-=")
                    || rest.starts_with(".clear()")
                    || rest.starts_with(".clone_from(")
                    || rest.starts_with(".push_str(");
                if assigns && receiver != "row" {
                    out.push(format!("line {}: {}", n + 1, line.trim()));
                }
            }
        }
    }
    out
}

#[test]
fn only_the_transitions_write_lifecycle_fields() {
    let mut found = Vec::new();
    for source in eitri_agent::testkit::sources::rust_sources() {
        let relative = source.relative.display().to_string();
        if ALLOWED.iter().any(|a| relative.starts_with(a)) {
            continue;
        }
        found.extend(
            writes(&source.text)
                .into_iter()
                .map(|w| format!("{relative} {w}")),
        );
    }

    assert!(
        found.is_empty(),
        "lifecycle fields written outside a transition:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_sees_an_assignment_and_not_a_comparison() {
    let text = "rec.stop_requested = true;\nif rec.boot_id == x {}\nrow.last_error = e;\nrec.last_error.clear();";

    let found = writes(text);

    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].starts_with("line 1"));
    assert!(found[1].starts_with("line 4"));
}
