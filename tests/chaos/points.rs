//! The crash points are one list: where `crash::point` is called (or a
//! point named with `crash::at`) in `src/`,
//! `crash::POINTS` (which the chaos proof walks), and the README's table.

use eitri_agent::crash::POINTS;

fn listed() -> Vec<String> {
    let mut names: Vec<String> = POINTS.iter().map(|(n, _)| n.to_string()).collect();
    names.sort();
    names
}

#[test]
fn every_point_placed_is_listed_once_and_every_listed_point_is_placed() {
    let mut placed = Vec::new();
    for source in eitri_agent::testkit::sources::rust_sources() {
        for marker in ["crash::point(\"", "crash::at(\""] {
            for piece in source.text.split(marker).skip(1) {
                if let Some(end) = piece.find('"') {
                    placed.push(piece[..end].to_string());
                }
            }
        }
    }
    placed.sort();

    assert_eq!(
        placed,
        listed(),
        "crash::point calls in src/ vs crash::POINTS"
    );
}

#[test]
fn the_readme_publishes_every_point() {
    let readme = include_str!("../../README.md");

    let missing: Vec<String> = listed()
        .into_iter()
        .filter(|n| !readme.contains(&format!("| `{n}` |")))
        .collect();

    assert!(
        missing.is_empty(),
        "not in README's crash-point table: {missing:?}"
    );
}
