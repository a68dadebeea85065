//! The reference pages of `docs/` served as HTML under `/docs/{page}`
//! (`/docs/proxy` is `docs/proxy.md`), beside the API's own page.
//!
//! The Markdown is built into the binary and rendered once, on first use,
//! with pulldown-cmark. The pages follow the API page's offline rule: no
//! script, style sheet, font or image from elsewhere, so they read the same
//! with no network. Links between pages become `/docs/…` links; a link to
//! another file of the repository (`../README.md`) goes to the repository.

use std::sync::LazyLock;

use pulldown_cmark::{CowStr, Event, HeadingLevel, Options, Parser, Tag, TagEnd};

/// One page: the name it is served under and its Markdown.
struct Source {
    slug: &'static str,
    markdown: &'static str,
}

/// Every page, in the order the `/docs` page lists them.
const SOURCES: &[Source] = &[
    Source {
        slug: "reservation-api",
        markdown: include_str!("../../../docs/reservation-api.md"),
    },
    Source {
        slug: "proxy",
        markdown: include_str!("../../../docs/proxy.md"),
    },
    Source {
        slug: "mcp",
        markdown: include_str!("../../../docs/mcp.md"),
    },
    Source {
        slug: "layer",
        markdown: include_str!("../../../docs/layer.md"),
    },
    Source {
        slug: "queue-consumers",
        markdown: include_str!("../../../docs/queue-consumers.md"),
    },
    Source {
        slug: "policy-and-errors",
        markdown: include_str!("../../../docs/policy-and-errors.md"),
    },
    Source {
        slug: "configuration",
        markdown: include_str!("../../../docs/configuration.md"),
    },
    Source {
        slug: "operations",
        markdown: include_str!("../../../docs/operations.md"),
    },
    Source {
        slug: "security",
        markdown: include_str!("../../../docs/security.md"),
    },
    Source {
        slug: "development",
        markdown: include_str!("../../../docs/development.md"),
    },
];

/// Where a link to a repository file that is not a page goes.
const REPOSITORY: &str = concat!(env!("CARGO_PKG_REPOSITORY"), "/blob/main/");

/// A rendered page.
pub struct Page {
    /// The name under `/docs/`.
    pub slug: &'static str,
    /// Its first heading, as text.
    pub title: String,
    /// The whole HTML document.
    pub html: String,
}

static PAGES: LazyLock<Vec<Page>> = LazyLock::new(|| SOURCES.iter().map(render).collect());

/// Every page, rendered.
pub fn pages() -> &'static [Page] {
    PAGES.as_slice()
}

/// The page served as `/docs/{slug}`, if there is one.
pub fn find(slug: &str) -> Option<&'static Page> {
    pages().iter().find(|p| p.slug == slug)
}

/// The `<li>` links to every page, for the `/docs` page.
pub fn index_items() -> String {
    pages()
        .iter()
        .map(|p| {
            format!(
                "<li><a href=\"/docs/{}\">{}</a></li>",
                p.slug,
                escape(&p.title)
            )
        })
        .collect()
}

fn render(source: &Source) -> Page {
    let options = Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH;
    let mut events: Vec<Event<'_>> = Parser::new_ext(source.markdown, options)
        .map(|event| match event {
            Event::Start(Tag::Link {
                link_type,
                dest_url,
                title,
                id,
            }) => Event::Start(Tag::Link {
                link_type,
                dest_url: link(dest_url),
                title,
                id,
            }),
            other => other,
        })
        .collect();
    let title = anchor_headings(&mut events);
    let mut body = String::new();
    pulldown_cmark::html::push_html(&mut body, events.into_iter());
    let html = format!(
        r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="color-scheme" content="light dark">
<title>{title} · idemgate</title>
<style>{STYLE}</style>
</head>
<body>
<nav><a href="/docs">idemgate docs</a>: the API (<a href="/docs">/docs</a>, <a href="/openapi.json">/openapi.json</a>) and the reference pages<ul>{index}</ul></nav>
<main>
{body}</main>
</body>
</html>
"#,
        title = escape(&title),
        index = index_items_but(source.slug),
    );
    Page {
        slug: source.slug,
        title,
        html,
    }
}

/// The index links, the page itself marked as the current one.
fn index_items_but(current: &str) -> String {
    SOURCES
        .iter()
        .map(|s| {
            let title = first_heading(s.markdown);
            if s.slug == current {
                format!("<li aria-current=\"page\">{}</li>", escape(&title))
            } else {
                format!(
                    "<li><a href=\"/docs/{}\">{}</a></li>",
                    s.slug,
                    escape(&title)
                )
            }
        })
        .collect()
}

/// The text of a page's `# ` line.
fn first_heading(markdown: &str) -> String {
    markdown
        .lines()
        .find_map(|l| l.strip_prefix("# "))
        .unwrap_or_default()
        .replace('`', "")
}

/// A link as the served pages need it: another page's `.md` becomes its
/// `/docs/` path, a file of the repository its address there; a fragment,
/// a URL and a path from the root stay as they are.
fn link(dest: CowStr<'_>) -> CowStr<'_> {
    if dest.starts_with('#') || dest.starts_with('/') || dest.contains("://") {
        return dest;
    }
    let (path, fragment) = match dest.split_once('#') {
        Some((path, fragment)) => (path, format!("#{fragment}")),
        None => (&*dest, String::new()),
    };
    if let Some(slug) = path.strip_suffix(".md")
        && SOURCES.iter().any(|s| s.slug == slug)
    {
        return format!("/docs/{slug}{fragment}").into();
    }
    let in_repository = path
        .strip_prefix("../")
        .unwrap_or(&format!("docs/{path}"))
        .to_owned();
    format!("{REPOSITORY}{in_repository}{fragment}").into()
}

/// Gives every heading the id GitHub gives it, so that `#fragment` links
/// work the same on the served page; returns the first heading's text.
fn anchor_headings(events: &mut [Event<'_>]) -> String {
    let mut seen: Vec<String> = Vec::new();
    let mut first = None;
    let mut at = 0;
    while at < events.len() {
        if let Event::Start(Tag::Heading { .. }) = &events[at] {
            let mut text = String::new();
            let mut end = at + 1;
            while end < events.len() && !matches!(events[end], Event::End(TagEnd::Heading(_))) {
                if let Event::Text(t) | Event::Code(t) = &events[end] {
                    text.push_str(t);
                }
                end += 1;
            }
            let base = slug(&text);
            let n = seen.iter().filter(|s| **s == base).count();
            seen.push(base.clone());
            let id = if n == 0 { base } else { format!("{base}-{n}") };
            if let Event::Start(Tag::Heading {
                level, id: slot, ..
            }) = &mut events[at]
            {
                if first.is_none() && *level == HeadingLevel::H1 {
                    first = Some(text.clone());
                }
                *slot = Some(id.into());
            }
            at = end;
        }
        at += 1;
    }
    first.unwrap_or_default()
}

/// GitHub's heading anchor: lower case, spaces to `-`, other punctuation
/// but `-` and `_` dropped.
fn slug(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The pages' whole style: the system's fonts and colours, tables that
/// scroll in a narrow window.
const STYLE: &str = "body{font-family:system-ui,sans-serif;line-height:1.5;margin:0 auto;\
max-width:60rem;padding:0 1rem}nav{font-size:.9rem;border-bottom:1px solid #8884;\
padding:.5rem 0}nav ul{margin:.25rem 0;padding-left:1.25rem;columns:2}\
table{border-collapse:collapse;display:block;overflow-x:auto}\
th,td{border:1px solid #8886;padding:.25rem .5rem;vertical-align:top}\
code{font-size:.9em}pre{overflow-x:auto;padding:.5rem;background:#8881}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headings_get_githubs_anchors() {
        assert_eq!(slug("Operators: stuck keys"), "operators-stuck-keys");
        assert_eq!(
            slug("TLS on idemgate's listeners"),
            "tls-on-idemgates-listeners"
        );
        assert_eq!(
            slug("A primary and its standbys: failover"),
            "a-primary-and-its-standbys-failover"
        );
    }

    #[test]
    fn links_lead_to_pages_or_the_repository() {
        assert_eq!(&*link("proxy.md".into()), "/docs/proxy");
        assert_eq!(
            &*link("operations.md#upgrading".into()),
            "/docs/operations#upgrading"
        );
        assert_eq!(&*link("#errors".into()), "#errors");
        assert_eq!(
            &*link("../README.md#reverse-proxy".into()),
            concat!(
                env!("CARGO_PKG_REPOSITORY"),
                "/blob/main/README.md#reverse-proxy"
            )
        );
    }

    #[test]
    fn every_page_has_its_title_and_no_outside_asset() {
        for page in pages() {
            assert!(!page.title.is_empty(), "{}", page.slug);
            for asset in ["<script", "<link", "<img", "@import", "url("] {
                assert!(!page.html.contains(asset), "{}: {asset}", page.slug);
            }
        }
    }
}
