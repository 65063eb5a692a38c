defmodule EMLXAxon.Qwen3.Model.State do
  @moduledoc """
  A loaded model: the native handle, its configuration and where it was
  loaded from. Build it with `EMLXAxon.Qwen3.Loader.load/2`.

  `:config` holds:

    * `:model_type` - `"qwen3"` or `"qwen2"`
    * `:num_layers`, `:hidden_size`, `:vocab_size`, `:num_heads`,
      `:num_kv_heads`, `:head_dim`, `:max_position_embeddings`
    * `:eos_token_ids` - the model's EOS tokens
    * `:dtype` - the compute dtype, such as `"bfloat16"`
    * `:quantization` - `nil` or `%{bits: 4, group_size: 64}`
    * `:load_ms` - how long loading took
    * `:weight_bytes` - the size of the checkpoint's weights, as stored
    * `:path` - the checkpoint directory
  """

  @enforce_keys [:ref, :config, :path]
  defstruct [:ref, :config, :path]

  @type config :: %{
          required(:model_type) => String.t(),
          required(:num_layers) => pos_integer(),
          required(:hidden_size) => pos_integer(),
          required(:vocab_size) => pos_integer(),
          required(:num_heads) => pos_integer(),
          required(:num_kv_heads) => pos_integer(),
          required(:head_dim) => pos_integer(),
          required(:max_position_embeddings) => pos_integer(),
          required(:eos_token_ids) => [non_neg_integer()],
          required(:dtype) => String.t(),
          required(:quantization) => nil | %{bits: pos_integer(), group_size: pos_integer()},
          required(:load_ms) => float(),
          required(:weight_bytes) => non_neg_integer(),
          required(:path) => String.t(),
          optional(atom()) => term()
        }

  @type t :: %__MODULE__{ref: reference(), config: config(), path: String.t()}

  defimpl Inspect do
    import Inspect.Algebra

    def inspect(%{config: config, path: path}, opts) do
      quant =
        case config[:quantization] do
          %{bits: bits, group_size: group} -> "#{bits}-bit/g#{group}"
          _ -> "dense"
        end

      summary =
        "#{config[:model_type]} #{config[:num_layers]} layers, #{config[:dtype]}, #{quant}"

      concat(["#EMLXAxon.Qwen3.Model.State<", summary, ", ", to_doc(path, opts), ">"])
    end
  end
end
