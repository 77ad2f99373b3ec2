//! The import layers `src/lib.rs` draws, checked over the source: a module
//! imports only from its own layer or below, and modules of one layer never
//! import each other in a circle. A new module must be given a layer here.
//!
//! Layers, lowest first:
//! 0. model and the small pieces everything shares (errors, deadlines, hex,
//!    log-once, wake-ups, versions)
//! 1. state, pb
//! 2. provision, net, image, seed, disk, hostkey
//! 3. reconcile
//! 4. source, config, status
//! 5. daemon
//! 6. testkit (fakes of everything, for tests), the subcommands (cli) and
//!    the binary
//!
//! And folders that must never name another: the VMM jail
//! (`provision/jail`) knows no hypervisor backend, so a second Linux
//! hypervisor takes it whole; the engine (`reconcile`) reads no frame of a
//! guest's (no packet socket: who woke a VM is the backend's to tell).
//!
//! And files of one folder that must never import one another: the
//! engine's verbs (create, converge, suspension, reap) never import each
//! other (each returns what should happen next, and only the spine,
//! `reconcile/step.rs`, knows them all), and the pass context
//! (`reconcile/context.rs`, `reconcile/pass.rs`) imports no verb, no
//! concern (sleepers, probes, holds, guests) and not the spine.

use std::collections::{BTreeMap, BTreeSet};

const LAYERS: &[(&str, u8)] = &[
    ("model", 0),
    ("base64", 0),
    ("crash", 0),
    ("deadline", 0),
    ("error", 0),
    ("hex", 0),
    ("logonce", 0),
    ("metrics", 0),
    ("version", 0),
    ("threads", 0),
    ("quote", 0),
    ("rng", 0),
    ("trust", 0),
    ("human", 0),
    ("programs", 0),
    ("stages", 0),
    ("state", 1),
    ("pb", 1),
    ("provision", 2),
    ("net", 2),
    ("image", 2),
    ("seed", 2),
    ("disk", 2),
    ("events", 2),
    ("hostkey", 2),
    ("guest", 2),
    ("reconcile", 3),
    ("usage", 3),
    ("source", 4),
    ("config", 4),
    ("status", 4),
    ("console", 4),
    ("daemon", 5),
    ("testkit", 6),
    ("cli", 6),
    ("main", 6),
    ("guest_main", 6),
];

/// Folders whose code must never name the modules listed.
const NEVERS: &[(&str, &[&str])] = &[
    ("provision/jail", &["cloudhv", "vfkit"]),
    ("reconcile", &["packet"]),
];

/// The engine's verbs.
const VERBS: &[&str] = &[
    "reconcile/create",
    "reconcile/converge",
    "reconcile/suspension",
    "reconcile/reap",
];

/// Members of a folder that must never import the siblings listed (by
/// `super::` or by the folder's full path), as [`sibling_edges`] reads
/// them.
fn sibling_nevers() -> Vec<(&'static str, Vec<&'static str>)> {
    let mut out: Vec<(&str, Vec<&str>)> = VERBS.iter().map(|v| (*v, VERBS.to_vec())).collect();
    let context_may_not: Vec<&str> = VERBS
        .iter()
        .copied()
        .chain([
            "reconcile/sleepers",
            "reconcile/probes",
            "reconcile/holds",
            "reconcile/guests",
            "reconcile/clones",
            "reconcile/panics",
            "reconcile/step",
        ])
        .collect();
    out.push(("reconcile/context", context_may_not.clone()));
    out.push(("reconcile/pass", context_may_not));
    out
}

/// Each sibling import [`sibling_nevers`] forbids: "reconcile/create
/// imports reconcile/converge".
fn sibling_nevers_broken(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for (member, never) in sibling_nevers() {
        for to in edges.get(member).into_iter().flatten() {
            if to != member && never.contains(&to.as_str()) {
                out.push(format!("{member} imports {to}"));
            }
        }
    }
    out
}

/// Each file under a `NEVERS` folder that names, in code, a module it must
/// not: "provision/jail/fork.rs names cloudhv".
fn nevers_broken(sources: &[(std::path::PathBuf, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (relative, text) in sources {
        for (folder, never) in NEVERS {
            if !relative.starts_with(folder) {
                continue;
            }
            for name in *never {
                let named = text.lines().any(|line| {
                    let code = line.split("//").next().unwrap_or("");
                    code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .any(|word| word == *name)
                });
                if named {
                    out.push(format!("{} names {name}", relative.display()));
                }
            }
        }
    }
    out
}

/// Every `crate::x` (or `eitri_agent::x`, from the binary) a source file
/// names, outside comments and outside its unit tests: a `#[cfg(test)] mod
/// tests` is test code, of the top layer wherever it sits, and may use the
/// testkit.
fn imports(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut previous = "";
    for line in text.lines() {
        if previous.trim() == "#[cfg(test)]" && line.trim() == "mod tests {" {
            break;
        }
        previous = line;
        let code = line.split("//").next().unwrap_or("");
        for prefix in ["crate::", "eitri_agent::"] {
            for (at, _) in code.match_indices(prefix) {
                let rest = &code[at + prefix.len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
        }
    }
    out
}

/// What a layering breaks: imports upward, and circles within a layer.
fn violations(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let layer = |m: &str| LAYERS.iter().find(|(n, _)| *n == m).map(|(_, l)| *l);
    let mut out = Vec::new();
    for (from, targets) in edges {
        let Some(lf) = layer(from) else {
            out.push(format!(
                "{from} has no layer: give it one in tests/layers.rs"
            ));
            continue;
        };
        for to in targets {
            match layer(to) {
                None => out.push(format!("{to} has no layer: give it one in tests/layers.rs")),
                Some(lt) if lt > lf => {
                    out.push(format!("{from} (layer {lf}) imports {to} (layer {lt})"))
                }
                _ => {}
            }
        }
    }
    // A circle: a module that reaches itself through other modules.
    out.extend(circles(edges));
    out
}

fn module_edges() -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for source in eitri_agent::testkit::sources::rust_sources() {
        let first = source
            .relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or_default();
        let module = first.trim_end_matches(".rs").to_owned();
        if module == "lib" {
            continue;
        }
        let targets = edges.entry(module.clone()).or_default();
        targets.extend(imports(&source.text).into_iter().filter(|t| *t != module));
    }
    edges
}

/// Inside each folder, at every depth, which of its files (or
/// subfolders) imports which sibling: `super::x` from a file directly in
/// the folder, or `crate::folder::x` from anywhere in it. A folder's
/// `mod.rs` is the folder itself (it declares and re-exports its
/// children): a member of the folder above, never of its own.
fn sibling_edges() -> BTreeMap<String, BTreeSet<String>> {
    let sources = eitri_agent::testkit::sources::rust_sources();
    let path_of = |relative: &std::path::Path| -> Vec<String> {
        let mut parts: Vec<String> = relative
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_str()
                    .unwrap_or_default()
                    .trim_end_matches(".rs")
                    .to_owned()
            })
            .collect();
        if parts.last().is_some_and(|p| p == "mod") {
            parts.pop();
        }
        parts
    };
    let mut members: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for source in &sources {
        let parts = path_of(&source.relative);
        for d in 1..parts.len() {
            members
                .entry(parts[..d].join("/"))
                .or_default()
                .insert(parts[d].clone());
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for source in &sources {
        let parts = path_of(&source.relative);
        for d in 1..parts.len() {
            let folder = parts[..d].join("/");
            let me = &parts[d];
            let siblings = &members[&folder];
            let mut prefixes = vec![format!("crate::{}::", parts[..d].join("::"))];
            if d == parts.len() - 1 {
                prefixes.push("super::".to_owned());
            }
            let mut named = BTreeSet::new();
            for line in source.text.lines() {
                let code = line.split("//").next().unwrap_or("");
                for prefix in &prefixes {
                    for (at, _) in code.match_indices(prefix.as_str()) {
                        // `super::` must not be the tail of a longer path.
                        if prefix == "super::" && code[..at].ends_with("::") {
                            continue;
                        }
                        let rest = &code[at + prefix.len()..];
                        // `use super::{a, b::C}`: each name in the braces.
                        let names: Vec<&str> = match rest.strip_prefix('{') {
                            Some(group) => group.split([',', '}']).collect(),
                            None => vec![rest],
                        };
                        for item in names {
                            let target: String = item
                                .trim()
                                .chars()
                                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                                .collect();
                            if siblings.contains(&target) && &target != me {
                                named.insert(target);
                            }
                        }
                    }
                }
            }
            edges
                .entry(format!("{folder}/{me}"))
                .or_default()
                .extend(named.into_iter().map(|t| format!("{folder}/{t}")));
        }
    }
    edges
}

/// Every circle in `edges`: a node that reaches itself through others,
/// reported once, from its smallest member.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut out = Vec::new();
    for start in edges.keys() {
        let mut seen = BTreeSet::new();
        let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            for next in edges.get(&at).into_iter().flatten() {
                if next == start {
                    let mut circle = path.clone();
                    circle.push(start.clone());
                    if path.iter().all(|m| m >= start) {
                        out.push(format!("import circle: {}", circle.join(" -> ")));
                    }
                } else if seen.insert(next.clone()) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    out
}

#[test]
fn no_two_files_of_a_folder_import_each_other_in_a_circle() {
    let edges = sibling_edges();

    let found = circles(&edges);

    assert!(
        found.is_empty(),
        "circles inside folders:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_folder_check_catches_a_circle_of_siblings() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("net/a", &["net/b"][..]),
        ("net/b", &["net/c"][..]),
        ("net/c", &["net/a"][..]),
        ("net/d", &["net/a"][..]),
    ]
    .into_iter()
    .map(|(m, ts)| (m.to_owned(), ts.iter().map(|t| t.to_string()).collect()))
    .collect();

    let found = circles(&edges);

    assert_eq!(found, ["import circle: net/a -> net/b -> net/c -> net/a"]);
}

#[test]
fn no_module_imports_upward_or_in_a_circle() {
    let edges = module_edges();

    let found = violations(&edges);

    assert!(found.is_empty(), "layering broken:\n{}", found.join("\n"));
}

#[test]
fn the_check_catches_an_upward_import_and_a_circle() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("provision", &["config"][..]),
        ("net", &["image"][..]),
        ("image", &["net"][..]),
    ]
    .into_iter()
    .map(|(m, ts)| (m.to_owned(), ts.iter().map(|t| t.to_string()).collect()))
    .collect();

    let found = violations(&edges);

    assert!(
        found.contains(&"provision (layer 2) imports config (layer 4)".to_owned()),
        "{found:?}"
    );
    assert!(
        found.contains(&"import circle: image -> net -> image".to_owned()),
        "{found:?}"
    );
}

#[test]
fn imports_are_read_from_code_not_comments() {
    let text =
        "use crate::model::Id;\n// see crate::daemon for why\nlet x = crate::hex::encode(b);";

    assert_eq!(
        imports(text),
        ["hex".to_owned(), "model".to_owned()].into_iter().collect()
    );
}

#[test]
fn a_files_unit_tests_are_not_its_imports() {
    let text =
        "use crate::model::Id;\n#[cfg(test)]\nmod tests {\n    use crate::testkit::logs;\n}\n";

    assert_eq!(imports(text), ["model".to_owned()].into_iter().collect());
}

#[test]
fn no_verb_imports_another_and_the_pass_context_imports_no_verb_or_concern() {
    let edges = sibling_edges();
    assert!(
        edges.contains_key("reconcile/step") && edges.contains_key("reconcile/create"),
        "the engine's files were not read"
    );

    let found = sibling_nevers_broken(&edges);

    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_sibling_never_check_catches_a_verb_importing_a_verb() {
    let edges: BTreeMap<String, BTreeSet<String>> = [
        (
            "reconcile/create",
            &["reconcile/suspension", "reconcile/context"][..],
        ),
        ("reconcile/context", &["reconcile/counts"][..]),
        ("reconcile/pass", &["reconcile/probes"][..]),
    ]
    .into_iter()
    .map(|(m, ts)| (m.to_owned(), ts.iter().map(|t| t.to_string()).collect()))
    .collect();

    let found = sibling_nevers_broken(&edges);

    assert_eq!(
        found,
        [
            "reconcile/create imports reconcile/suspension",
            "reconcile/pass imports reconcile/probes"
        ]
    );
}

#[test]
fn the_jail_names_no_hypervisor_backend_and_the_engine_no_packet_socket() {
    let sources: Vec<_> = eitri_agent::testkit::sources::rust_sources()
        .into_iter()
        .map(|s| (s.relative, s.text))
        .collect();
    assert!(
        sources.iter().any(|(p, _)| p.starts_with("provision/jail")),
        "no source under provision/jail was read"
    );

    let found = nevers_broken(&sources);

    assert!(
        found.is_empty(),
        "a folder names what it must not:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_never_check_catches_a_backend_named_in_code_not_in_comments() {
    let sources = vec![
        (
            "provision/jail/fork.rs".into(),
            "use crate::provision::cloudhv::error::CloudHvError;\n".to_owned(),
        ),
        (
            "provision/jail/view.rs".into(),
            "// unlike vfkit, this is Linux only\n".to_owned(),
        ),
        (
            "provision/cloudhv/spawn.rs".into(),
            "use crate::provision::vfkit;\n".to_owned(),
        ),
    ];

    let found = nevers_broken(&sources);

    assert_eq!(found, ["provision/jail/fork.rs names cloudhv"]);
}
