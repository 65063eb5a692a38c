# Used by "mix format"
[
  inputs: [
    "{mix,.formatter}.exs",
    "native/mix_compiler.ex",
    "native/mix/*.ex",
    "{config,lib,test}/**/*.{ex,exs}"
  ]
]
