defmodule EMLXAxon.Result do
  @moduledoc """
  What generating from one prompt gives, the same keys in every API.

  ## Result

  Each prompt's result is a map with:

    * `:text` - the generated text (an EOS token and a matched stop
      string left out)
    * `:generated_text` - the same text (EMLXAxon's older name for it)
    * `:token_ids` - the generated token ids, the EOS token included when
      generation stopped on one
    * `:num_tokens` - `length(token_ids)`
    * `:finish_reason` - why it ended: `:eos` (the model's end of
      sequence), `:stop` (a `:stop` string, or a constrained output that is
      complete), `:length` (`:max_new_tokens`), `:max_len` (the KV cache
      budget), `:timeout`, or `:cancelled` (in a static serving's batch, a
      row whose caller exited while the others went on)
    * `:token_summary` - Bumblebee's `%{input: n, output: n, padding: n}`:
      the prompt's tokens, the generated tokens and the left padding the
      prompt was given to share a batch with longer prompts (0 through a
      scheduler)

  `EMLXAxon.TextGeneration` results may also have `:tool_calls` and
  `:tool_call_errors` (with its `tools:` option).

  ## Metadata

  Beside each result (see below) is its metadata: token counts, timings
  and how it was generated.

    * `:prompt_tokens`, `:generated_tokens` - the prompt's tokens and the
      generated ones
    * `:batch_size` - the rows decoded together with it (1 through a
      scheduler)
    * `:prefill_ms`, `:decode_ms`, `:decode_tokens_per_s`,
      `:time_to_first_token_ms` - the batch's timings; measured only with
      `profile_timing: true` (0.0 otherwise), always through a scheduler
    * `:total_ms` - wall time of the call, measured in Elixir
    * `:decode_path`, `:prefill_path` - which engine path decoded and
      prefilled it (binaries such as `"cuda_replay"`, `"cuda_layers"`,
      `"cpu_layers"` or `"mlx"`), `nil` where the engine does not say
    * `:fallbacks` - a list of binaries, each a reason a faster path was
      not taken (`nil` where the engine does not say)
    * `:kv_dtype` - the dtype the KV cache kept its keys and values in
      (`:float32`, `:bfloat16` or `:float16`; before any `kv_bits`
      quantization), `nil` where the engine does not say

  A direct generation (without a scheduler) also has `:forced_tokens`:
  tokens a constraint allowed alone, so they were appended without a
  forward pass. Through an `EMLXAxon.Scheduler`, the metadata also has
  `:queue_ms` (waiting for a slot), `:cached_tokens` (prompt tokens reused
  from its prefix cache) and `:constraint_ms` (host time spent on the
  request's constraint).

  ## Where each API puts them

    * `EMLXAxon.TextGeneration` (`run/4`, `stream/5` and its serving):
      Bumblebee's output, `%{results: [result], metadata: metadata}`
    * `EMLXAxon.Qwen3.Generate.generate/3`: `{:ok, result}` where `result`
      also has `:metadata` (and `:timings`, the same map)
    * `EMLXAxon.Scheduler.generate/3`: `{:ok, result}` where `result` also
      has `:metadata`, `:ids` (the same as `:token_ids`) and `:stats` (the
      scheduler's raw figures, as in its `:done` message)
  """

  @type finish_reason :: :eos | :stop | :length | :max_len | :timeout | :cancelled

  @type t :: %{
          required(:text) => String.t(),
          required(:generated_text) => String.t(),
          required(:token_ids) => [non_neg_integer()],
          required(:num_tokens) => non_neg_integer(),
          required(:finish_reason) => finish_reason(),
          required(:token_summary) => %{
            input: non_neg_integer(),
            output: non_neg_integer(),
            padding: non_neg_integer()
          },
          optional(atom()) => term()
        }

  @type metadata :: %{
          required(:prompt_tokens) => non_neg_integer(),
          required(:generated_tokens) => non_neg_integer(),
          required(:batch_size) => pos_integer(),
          required(:prefill_ms) => float(),
          required(:decode_ms) => float(),
          required(:decode_tokens_per_s) => float(),
          required(:time_to_first_token_ms) => float(),
          required(:total_ms) => float(),
          required(:decode_path) => String.t() | nil,
          required(:prefill_path) => String.t() | nil,
          required(:fallbacks) => [String.t()] | nil,
          required(:kv_dtype) => EMLXAxon.Options.kv_dtype() | nil,
          optional(:forced_tokens) => non_neg_integer(),
          optional(:queue_ms) => float(),
          optional(:cached_tokens) => non_neg_integer(),
          optional(:constraint_ms) => float()
        }

  @doc false
  # The result of one row: its generated ids and text, why it ended, its
  # prompt's length and the left padding it was given.
  @spec new(
          [non_neg_integer()],
          String.t(),
          finish_reason(),
          non_neg_integer(),
          non_neg_integer()
        ) ::
          t()
  def new(ids, text, finish_reason, prompt_tokens, padding) do
    output = length(ids)

    %{
      text: text,
      generated_text: text,
      token_ids: ids,
      num_tokens: output,
      finish_reason: finish_reason,
      token_summary: %{input: prompt_tokens, output: output, padding: padding}
    }
  end

  @doc false
  # The left padding of each of a batch's rows: the engine aligns prompts
  # of different lengths on the right.
  @spec paddings([non_neg_integer()]) :: [non_neg_integer()]
  def paddings(prompt_lengths) do
    longest = Enum.max(prompt_lengths, fn -> 0 end)
    Enum.map(prompt_lengths, &(longest - &1))
  end

  @doc false
  # The engine paths a native stats map names, and its KV cache's dtype.
  # Engines that do not report them give nil, so this reads them whether
  # or not they are there.
  @spec paths(map() | nil) :: %{
          decode_path: String.t() | nil,
          prefill_path: String.t() | nil,
          fallbacks: [String.t()] | nil,
          kv_dtype: EMLXAxon.Options.kv_dtype() | nil
        }
  def paths(stats) do
    stats = stats || %{}

    %{
      decode_path: Map.get(stats, :decode_path),
      prefill_path: Map.get(stats, :prefill_path),
      fallbacks: Map.get(stats, :fallbacks),
      kv_dtype: EMLXAxon.Options.kv_dtype_of(Map.get(stats, :kv_dtype))
    }
  end

  @doc false
  # The metadata of a request run through an EMLXAxon.Scheduler, from the
  # stats of its `:done` message (empty when it timed out).
  @spec scheduled_metadata(map() | nil, non_neg_integer(), pos_integer(), float()) :: metadata()
  def scheduled_metadata(stats, generated, batch_size, total_ms) do
    stats = stats || %{}
    generated = Map.get(stats, :generated_tokens, generated)
    rate = float(stats[:decode_tokens_per_s])

    Map.merge(
      %{
        prompt_tokens: Map.get(stats, :prompt_tokens, 0),
        generated_tokens: generated,
        batch_size: batch_size,
        prefill_ms: float(stats[:prefill_ms]),
        decode_ms: if(rate > 0, do: max(generated - 1, 0) / rate * 1000, else: 0.0),
        decode_tokens_per_s: rate,
        time_to_first_token_ms: float(stats[:time_to_first_token_ms]),
        total_ms: total_ms,
        queue_ms: float(stats[:queue_ms]),
        cached_tokens: Map.get(stats, :cached_tokens, 0),
        constraint_ms: float(stats[:constraint_ms])
      },
      paths(stats)
    )
  end

  defp float(nil), do: 0.0
  defp float(value) when is_number(value), do: value / 1
end
