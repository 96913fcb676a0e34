//! Imports a GGUF into a Hugging Face directory: `import_gguf MODEL.gguf OUT_DIR`.

use std::path::PathBuf;
use std::time::Instant;

fn main() {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [gguf, out] = args.as_slice() else {
        eprintln!("usage: import_gguf MODEL.gguf OUT_DIR");
        std::process::exit(2);
    };
    let start = Instant::now();
    let mut last = 0u64;
    let result = libvoom::import::import_gguf(gguf, out, &mut |done, total| {
        let pct = done * 100 / total.max(1);
        if pct >= last + 10 || done == total {
            last = pct;
            eprintln!("{pct:>3}% ({done} / {total} bytes of tensor data)");
        }
    });
    match result {
        Ok(r) => println!("{r:#?}\nin {:.2?}", start.elapsed()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
