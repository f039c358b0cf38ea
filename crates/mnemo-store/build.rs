// `sqlx::migrate!` embeds the migrations at compile time; a new file must rebuild this crate.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
