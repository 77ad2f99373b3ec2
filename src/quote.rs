//! Untrusted text, made safe to print. Ids, URLs and values from the wire,
//! and what a guest or its hypervisor writes, may hold newlines (a forged
//! log line), terminal escapes (a rewritten screen) or bytes that are not
//! UTF-8. Wherever such text reaches a log line or a terminal it goes
//! through here, so what an operator reads is what was sent and nothing
//! more.

use std::path::Path;

/// Untrusted text longer than this is cut (and says so with `…`).
const SHOWN: usize = 80;

/// `raw` for an error message: in double quotes, control characters and
/// quotes escaped, cut to a length that keeps a log line readable
/// (`"a\nb"`).
pub fn text(raw: &str) -> String {
    let mut cut: String = raw.chars().take(SHOWN).collect();
    if cut.len() < raw.len() {
        cut.push('…');
    }
    format!("{cut:?}")
}

/// A path, quoted as [`text`] but whole; bytes that are not UTF-8 are
/// escaped.
pub fn path(p: &Path) -> String {
    format!("{p:?}")
}

/// Text shown as it is but for its control characters, each escaped
/// (newlines too): for a table cell or a log's tail, where quotes would be
/// noise but a guest's escape sequence must not move the cursor or start a
/// line that looks like the agent's.
pub fn inline(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// A line of a guest's console as [`inline`] shows it, its terminal
/// sequences (colours, cursor moves: `ESC [ … final`, `ESC ] … BEL`, and
/// any other `ESC x`) left out rather than escaped: a boot's coloured
/// `[  OK  ]` read as `\u{1b}[0;32m  OK  \u{1b}[0m`, its words lost in the
/// noise. A carriage return is read as a terminal reads it: the line's end
/// of a serial console's CRLF is dropped, and what a line wrote over
/// itself (a progress count) shows its last state. Other control
/// characters are escaped as `inline` escapes them.
pub fn console(s: &str) -> String {
    let mut plain = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            plain.push(c);
            continue;
        }
        match chars.next() {
            // CSI: parameters and intermediates, then one final byte.
            Some('[') => {
                for c in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c) {
                        break;
                    }
                }
            }
            // OSC: up to BEL, or ESC \\.
            Some(']') => {
                while let Some(c) = chars.next() {
                    if c == '\u{7}' {
                        break;
                    }
                    if c == '\u{1b}' && chars.peek() == Some(&'\\') {
                        chars.next();
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    let shown = plain
        .rsplit('\r')
        .find(|part| !part.is_empty())
        .unwrap_or_default();
    inline(shown)
}

/// A URL with any credentials in it (`http://user:secret@host/`) replaced
/// by `***`: for every place a URL from the wire or the command line is
/// printed, logged or reported.
pub fn url(raw: &str) -> std::borrow::Cow<'_, str> {
    let Some(start) = raw.find("://").map(|i| i + 3) else {
        return raw.into();
    };
    let authority_end = raw[start..]
        .find(['/', '?', '#'])
        .map_or(raw.len(), |i| start + i);
    match raw[start..authority_end].rfind('@') {
        Some(at) => format!("{}***{}", &raw[..start], &raw[start + at..]).into(),
        None => raw.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_console_line_loses_its_colours_and_keeps_its_words() {
        let line = "[\u{1b}[0;32m  OK  \u{1b}[0m] Started \u{1b}]0;title\u{7}ssh.service\u{8}.";

        assert_eq!(console(line), "[  OK  ] Started ssh.service\\u{8}.");
    }

    #[test]
    fn a_console_lines_crlf_end_is_no_character_of_it() {
        assert_eq!(
            console("[  OK  ] Reached target getty.\r"),
            "[  OK  ] Reached target getty."
        );
    }

    #[test]
    fn a_console_line_written_over_itself_shows_its_last_state() {
        assert_eq!(console("fsck 10%\rfsck 60%\rfsck 100%\r"), "fsck 100%");
    }

    #[test]
    fn credentials_in_a_url_are_hidden() {
        assert_eq!(
            url("http://ann:s3cret@mirror:8080/a.raw?x=@y"),
            "http://***@mirror:8080/a.raw?x=@y"
        );
        assert_eq!(url("http://mirror/a@b.raw"), "http://mirror/a@b.raw");
        assert_eq!(url("file:///srv/a.raw"), "file:///srv/a.raw");
    }

    #[test]
    fn a_newline_and_an_escape_are_shown_not_obeyed() {
        assert_eq!(text("vm\n\u{1b}[2Jx"), r#""vm\n\u{1b}[2Jx""#);
    }

    #[test]
    fn long_text_is_cut_and_says_so() {
        let shown = text(&"a".repeat(200));

        assert_eq!(shown.chars().count(), SHOWN + 3, "{shown}");
        assert!(shown.ends_with("…\""), "{shown}");
    }

    #[test]
    fn inline_text_keeps_its_words_but_not_its_escapes() {
        assert_eq!(inline("ok\n\u{1b}[31mred\r"), "ok\\n\\u{1b}[31mred\\r");
    }
}
