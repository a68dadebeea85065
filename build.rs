//! The migrations are embedded at compile time (`sqlx::migrate!`), which
//! does not tell Cargo to watch their folder: without this, a new migration
//! file would not be built in until something else changed.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
