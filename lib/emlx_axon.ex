defmodule EMLXAxon do
  @moduledoc """
  Qwen text generation for Elixir, running on Apple's MLX through a Rust NIF.

  The model's forward pass, sampling and KV cache run natively; Elixir
  drives generation chunk by chunk, so it can stream text, time out and be
  cancelled without blocking the VM.

    * `EMLXAxon.TextGeneration` - text in, text out: `run/4`, `stream/5`
      and an `Nx.Serving` (when your application has Nx)
    * `EMLXAxon.Qwen3.Loader` - loads Qwen3 and Qwen2 checkpoints, quantized
      (MLX format) or dense, optionally quantizing them as they load
    * `EMLXAxon.Qwen3.Generate` - token ids in, token ids out
    * `EMLXAxon.Tokenizer` - Hugging Face tokenizers and chat templates
    * `EMLXAxon.Stream` - MLX streams, to run generations concurrently
    * `EMLXAxon.Telemetry` - telemetry events (with the optional `:telemetry`)

  ## Quick start

      {:ok, tokenizer} = EMLXAxon.Tokenizer.load("~/models/Qwen3-0.6B-MLX-4bit")
      {:ok, state} = EMLXAxon.Qwen3.Loader.load("~/models/Qwen3-0.6B-MLX-4bit")

      EMLXAxon.TextGeneration.stream(tokenizer, state, [%{role: "user", content: "Hi!"}], &IO.write/1)

  Or from the command line: `mix emlx_axon.generate --help`.
  """

  @doc """
  Returns information about the MLX runtime: its version, the default
  device and whether a GPU is available.

  ## Examples

      iex> %{mlx_version: version, default_device: device} = EMLXAxon.mlx_info()
      iex> is_binary(version) and device in [:cpu, :gpu]
      true

  """
  @spec mlx_info() :: %{
          mlx_version: String.t(),
          default_device: :cpu | :gpu,
          gpu_available: boolean()
        }
  def mlx_info, do: EMLXAxon.Native.mlx_info()
end
