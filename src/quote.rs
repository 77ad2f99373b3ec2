//! Untrusted text, made safe to print. Ids, URLs, paths and error text from
//! the wire or a guest may hold newlines (a forged log line), terminal
//! escapes (a rewritten screen) or bytes that are not UTF-8. Wherever such
//! text reaches a log line or a terminal it goes through here: quoted, with
//! every control character escaped, so what an operator reads is what was
//! sent and nothing more.

use std::path::Path;

/// `s` in double quotes, control characters and quotes escaped (`"a\nb"`).
pub fn text(s: &str) -> String {
    format!("{s:?}")
}

/// A path, quoted as [`text`]; bytes that are not UTF-8 are escaped.
pub fn path(p: &Path) -> String {
    format!("{p:?}")
}

/// Text for a terminal or a log that is not quoted as a whole (a log's
/// tail): each control character but the newline escaped, so a guest's
/// output cannot move the cursor or forge lines that look like ours.
pub fn lines(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' => out.push('\n'),
            c if c.is_control() => out.extend(c.escape_default()),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newline_and_an_escape_are_shown_not_obeyed() {
        assert_eq!(text("vm\n\u{1b}[2Jx"), r#""vm\n\u{1b}[2Jx""#);
    }

    #[test]
    fn a_tail_keeps_its_lines_but_not_its_escapes() {
        assert_eq!(lines("ok\n\u{1b}[31mred\r"), "ok\n\\u{1b}[31mred\\r");
    }
}
