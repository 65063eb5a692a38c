defmodule EMLXAxon.Scheduler do
  @moduledoc """
  Continuous batching for one loaded model: a process that owns a running
  batch of fixed slots and serves requests from any process.

  Requests join the running batch as soon as a slot is free: their prompt is
  run in bounded chunks between decode steps (so running rows keep their
  pace), and a finished row leaves at once, freeing its slot. Each request
  has its own options (`:max_new_tokens`, `:stop`, EOS, sampler,
  temperature, `:top_k`/`:top_p`/`:min_p` and `:seed`): a seeded request
  samples the same tokens whatever it is batched with, and a greedy request
  gives the ids of its solo run. Keys and values of earlier prompts are kept
  (bounded by `:prefix_cache_bytes`, least recently used first out) and
  reused by later prompts that start with the same tokens.

  A request may constrain its output with `:json_schema`, `:regex` or
  `:grammar` (see "Structured output" in `EMLXAxon.TextGeneration`; the
  scheduler needs a `:tokenizer` for them): its row's logits are masked to
  the tokens that can continue a valid output before its sampler runs,
  each row independently, so constrained and free requests share the
  batch (a free request gives the tokens it would without them). A
  constrained request ends with finish reason `:stop` once its output is
  complete. The masks are computed on the host while the device runs the
  step's forward pass; with a constrained row running, a step is sampled
  only once the previous step's tokens are read back (only the forward pass
  is queued ahead).

  The batch is stepped on a native thread of the scheduler's own, which
  queues each decode step before the previous one is read back and sends
  every step's tokens to the process as soon as they are read: no dirty
  scheduler is held, and the device does not wait between steps. A new
  request or a cancellation interrupts the steps within one step; while a
  prompt is prefilled, its chunks alternate with up to `:steps_per_call`
  decode steps within `:step_budget_ms`.

  ## Messages

  `submit/3` returns a reference; the caller then receives

    * `{EMLXAxon.Scheduler, ref, {:tokens, ids, text}}` - new tokens and
      their text (text that could start a stop string is held back)
    * `{EMLXAxon.Scheduler, ref, {:done, finish_reason, stats}}` - the
      last message: `finish_reason` is `:eos`, `:stop`, `:length`,
      `:max_len` or `:timeout`; `stats` holds `:prompt_tokens`,
      `:cached_tokens` (reused from the prefix cache), `:generated_tokens`,
      `:queue_ms`, `:prefill_ms`, `:time_to_first_token_ms`,
      `:decode_tokens_per_s` and `:constraint_ms` (host time spent on the
      request's constraint, 0 without one), and the engine's
      `:decode_path`, `:prefill_path`, `:fallbacks` and `:kv_dtype` where
      it reports them (see `EMLXAxon.Result`); only `:prompt_tokens` after a
      `:timeout`
    * `{EMLXAxon.Scheduler, ref, {:error, %EMLXAxon.Error{}}}` - the
      request failed (also the last message)

  The caller is monitored: when it exits, its request is dropped at the next
  step, also while its prompt is being prefilled. `:timeout` (milliseconds)
  ends a request with finish reason `:timeout`. Past `:max_queue` waiting
  requests, `submit/3` returns `{:error, :overloaded}`.

  ## Telemetry

  `[:emlx_axon, :scheduler, :step]` after every step that produced tokens and
  `[:emlx_axon, :scheduler, :request]` when a request ends: see
  `EMLXAxon.Telemetry`.

  ## Example

      {:ok, server} = EMLXAxon.Scheduler.start_link(model: state, tokenizer: tokenizer)
      {:ok, %{text: text}} = EMLXAxon.Scheduler.generate(server, "Hello", max_new_tokens: 8)

  """

  alias EMLXAxon.{Error, Options, Result, Tokenizer}
  alias EMLXAxon.Qwen3.Model.State
  alias EMLXAxon.Scheduler.Server

  @start_schema [
    model: [
      type: {:struct, State, "an EMLXAxon.Qwen3.Model.State"},
      required: true,
      doc: "the loaded model"
    ],
    tokenizer: [
      type: {:or, [{:struct, Tokenizer, "an EMLXAxon.Tokenizer"}, nil]},
      default: nil,
      doc: "for text prompts, text output, stop strings and constraints"
    ],
    slots: [type: :pos_integer, default: 8, doc: "rows decoded together"],
    capacity: [
      type: :pos_integer,
      default: 2048,
      doc:
        "positions (prompt plus generated tokens) per row; a request's `:max_len` is " <>
          "capped at it"
    ],
    prefill_chunk: [
      type: {:or, [{:in, [:auto]}, :pos_integer]},
      default: :auto,
      doc:
        "most prompt tokens run between two decode steps, also the most padded tokens of " <>
          "short prompts prefilled together; `:auto` is 512 where MLX's default device is a " <>
          "GPU, whose prefill pass costs about the same for 128 tokens as for 512, and 128 on " <>
          "the CPU, where it costs in proportion and running rows would wait"
    ],
    steps_per_call: [
      type: :pos_integer,
      default: 64,
      doc:
        "while a prompt is being prefilled, most decode steps between two of its chunks " <>
          "(otherwise the batch decodes without a limit until a request arrives, is " <>
          "cancelled or can take a freed slot)"
    ],
    step_budget_ms: [
      type: :non_neg_integer,
      default: 20,
      doc:
        "while a prompt is being prefilled, no further decode step starts once this many " <>
          "milliseconds have passed since its last chunk (at least one runs; `0`: " <>
          "`:steps_per_call` alone), so that its first token does not wait behind many " <>
          "short GPU steps, nor the batch behind many long CPU chunks"
    ],
    max_queue:
      Options.max_queue(
        "requests that may wait for a slot, past the `:slots` running ones; past them " <>
          "`submit/3` answers `{:error, :overloaded}` at once"
      ),
    prefix_cache_bytes: [
      type: :non_neg_integer,
      default: 256 * 1024 * 1024,
      default_doc: "256 MiB",
      doc: "budget of the prefix cache; `0` turns it off"
    ],
    prefix_min_tokens: [
      type: :non_neg_integer,
      default: 16,
      doc: "shortest prompt prefix stored or reused"
    ],
    kv_dtype: [
      type: {:or, [nil, {:in, Options.kv_dtypes()}]},
      default: nil,
      doc:
        "the slots' keys and values dtype (`nil`: `:float16` under a float32 model on the " <>
          "CPU, which halves what a long context's decode step reads there, the model's " <>
          "dtype elsewhere). A request naming another `:kv_dtype` fails"
    ],
    name: [
      type: {:custom, {__MODULE__, :name_option}, "nil or a GenServer name"},
      default: nil,
      doc: "a name to register the process under"
    ]
  ]

  @submit_schema Options.generation() ++
                   Options.constraints() ++
                   [
                     timeout: [
                       type:
                         {:custom, {Options, :timeout},
                          "a non-negative integer (milliseconds) or :infinity"},
                       default: :infinity,
                       doc: "time after which the request ends with finish reason `:timeout`"
                     ]
                   ]

  @type server :: GenServer.server()
  @type event ::
          {:tokens, [non_neg_integer()], String.t()}
          | {:done, atom(), map()}
          | {:error, Error.t()}

  @doc """
  Starts a scheduler for a loaded model.

  ## Options

  #{Options.docs(@start_schema)}
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts) do
    opts = Options.validate!(opts, @start_schema, "EMLXAxon.Scheduler.start_link/1")
    gen_opts = if opts.name, do: [name: opts.name], else: []
    Server.start_link(opts, gen_opts)
  end

  @doc false
  def child_spec(opts) do
    %{id: Keyword.get(opts, :name, __MODULE__), start: {__MODULE__, :start_link, [opts]}}
  end

  @doc """
  Submits a request. `prompt` is a list of token ids, or a string when the
  scheduler has a tokenizer.

  Returns `{:ok, ref}`; the tokens arrive as messages to the calling process
  (see the module documentation). `{:error, :overloaded}` when the queue is
  full; `{:error, %EMLXAxon.Error{}}` when the engine refuses the request.
  Invalid options, and a schema, regex or grammar the engine refuses, raise
  `ArgumentError` before the request is queued.

  ## Options

  The generation options of `EMLXAxon.Qwen3.Generate.generate/3`, at most
  one constraint (`:json_schema`, `:regex` or `:grammar`, which need a
  scheduler started with a `:tokenizer`) and `:timeout`:

  #{Options.docs(@submit_schema)}
  """
  @spec submit(server(), [non_neg_integer()] | String.t(), keyword()) ::
          {:ok, reference()} | {:error, :overloaded | Error.t()}
  def submit(server, prompt, opts \\ []) do
    {native, timeout} = validate_request_opts!(opts)
    check_prompt!(prompt)

    case GenServer.call(server, {:submit, self(), prompt, native, timeout}, :infinity) do
      {:raise, message} -> raise ArgumentError, message
      reply -> reply
    end
  end

  defp check_prompt!(text) when is_binary(text) do
    unless String.valid?(text) do
      raise ArgumentError, "expected a text prompt to be valid UTF-8, got: #{inspect(text)}"
    end
  end

  defp check_prompt!([_ | _] = ids) do
    unless Enum.all?(ids, &(is_integer(&1) and &1 >= 0 and &1 < 4_294_967_296)) do
      raise ArgumentError, "expected a prompt of token ids, got: #{inspect(ids)}"
    end
  end

  defp check_prompt!(other) do
    raise ArgumentError,
          "expected a prompt (a non-empty list of token ids or a string), got: #{inspect(other)}"
  end

  @doc "Cancels a request of the calling process (or any, given its ref); its slot is freed."
  @spec cancel(server(), reference()) :: :ok
  def cancel(server, ref) when is_reference(ref) do
    GenServer.call(server, {:cancel, ref}, :infinity)
  end

  @doc """
  Submits a request and waits for its end. Returns `{:ok, result}`: an
  `EMLXAxon.Result` with its `:metadata`, and also `:ids` (the same as
  `:token_ids`) and `:stats` (the `:done` message's). When the scheduler is
  not running, or exits before the request ends, `{:error, %EMLXAxon.Error{kind:
  :scheduler_down}}` (at once: the scheduler is monitored).
  """
  @spec generate(server(), [non_neg_integer()] | String.t(), keyword()) ::
          {:ok, map()} | {:error, :overloaded | Error.t()}
  def generate(server, prompt, opts \\ []) do
    started = System.monotonic_time()

    # Watched, so that a scheduler exiting ends the wait with an error.
    case GenServer.whereis(server) do
      pid when is_pid(pid) ->
        monitor = Process.monitor(pid)

        try do
          with {:ok, ref} <- submit_watched(pid, prompt, opts) do
            collect(ref, monitor, [], [], started)
          end
        after
          Process.demonitor(monitor, [:flush])
        end

      _ ->
        {:error, down(server, :noproc)}
    end
  end

  # submit/3, with a scheduler that exits during the call as an error.
  defp submit_watched(pid, prompt, opts) do
    submit(pid, prompt, opts)
  catch
    :exit, {reason, {GenServer, :call, _}} -> {:error, down(pid, reason)}
  end

  defp down(server, reason) do
    Error.exception(
      kind: :scheduler_down,
      message: "the scheduler #{inspect(server)} is not running (#{inspect(reason)})"
    )
  end

  defp collect(ref, monitor, ids, text, started) do
    receive do
      {__MODULE__, ^ref, {:tokens, new_ids, new_text}} ->
        collect(ref, monitor, [new_ids | ids], [text, new_text], started)

      # After any message the scheduler sent before exiting.
      {:DOWN, ^monitor, :process, pid, reason} ->
        {:error, down(pid, reason)}

      {__MODULE__, ^ref, {:done, reason, stats}} ->
        ids = ids |> Enum.reverse() |> Enum.concat()
        text = IO.iodata_to_binary(text)

        total_ms =
          System.convert_time_unit(System.monotonic_time() - started, :native, :microsecond) /
            1000

        metadata = Result.scheduled_metadata(stats, length(ids), 1, total_ms)

        result =
          ids
          |> Result.new(text, reason, metadata.prompt_tokens, 0)
          |> Map.merge(%{ids: ids, stats: stats, metadata: metadata})

        {:ok, result}

      {__MODULE__, ^ref, {:error, error}} ->
        {:error, error}
    end
  end

  @doc """
  Submits a request and returns a lazy stream of `{ids, text}` chunks.
  Halting the stream early cancels the request. Raises on errors, also
  `EMLXAxon.Error` (kind `:scheduler_down`) when the scheduler exits.
  """
  @spec stream(server(), [non_neg_integer()] | String.t(), keyword()) :: Enumerable.t()
  def stream(server, prompt, opts \\ []) do
    Stream.resource(
      fn ->
        pid = GenServer.whereis(server) || raise down(server, :noproc)
        monitor = Process.monitor(pid)

        case submit_watched(pid, prompt, opts) do
          {:ok, ref} ->
            {:running, ref, monitor}

          {:error, error} ->
            Process.demonitor(monitor, [:flush])

            if error == :overloaded,
              do: raise(Error, kind: :overloaded, message: "the queue is full"),
              else: raise(error)
        end
      end,
      fn
        {:done, _ref, _monitor} = acc ->
          {:halt, acc}

        {:running, ref, monitor} = acc ->
          receive do
            {__MODULE__, ^ref, {:tokens, ids, text}} -> {[{ids, text}], acc}
            {__MODULE__, ^ref, {:done, _reason, _stats}} -> {:halt, {:done, ref, monitor}}
            {__MODULE__, ^ref, {:error, error}} -> raise error
            {:DOWN, ^monitor, :process, pid, reason} -> raise down(pid, reason)
          end
      end,
      fn
        {:running, ref, monitor} ->
          Process.demonitor(monitor, [:flush])

          try do
            cancel(server, ref)
          catch
            # Gone already: nothing of it is left to free.
            :exit, _ -> :ok
          end

        {:done, _ref, monitor} ->
          Process.demonitor(monitor, [:flush])
      end
    )
  end

  @doc """
  Slot use: `%{running: n, waiting: n, slots: n, prefix_entries: n,
  prefix_bytes: n}`.
  """
  @spec occupancy(server()) :: map()
  def occupancy(server), do: GenServer.call(server, :occupancy, :infinity)

  @doc false
  # The model and tokenizer the scheduler serves, for callers that encode
  # their own prompts and must check they target the same model.
  @spec model(server()) :: %{model: State.t(), tokenizer: Tokenizer.t() | nil}
  def model(server), do: GenServer.call(server, :model, :infinity)

  @doc "Drops every stored prompt prefix."
  @spec clear_prefix_cache(server()) :: :ok
  def clear_prefix_cache(server), do: GenServer.call(server, :clear_prefix_cache, :infinity)

  @doc "Stops the scheduler; running requests end with an error."
  @spec stop(server()) :: :ok
  def stop(server), do: GenServer.stop(server)

  ## Options

  @doc false
  # The option schemas, for tests and tools that read them.
  def __schema__(:start_link), do: @start_schema
  def __schema__(:submit), do: @submit_schema

  @doc false
  def name_option(name) when is_atom(name), do: {:ok, name}
  def name_option({:global, _} = name), do: {:ok, name}
  def name_option({:via, module, _} = name) when is_atom(module), do: {:ok, name}
  def name_option(_other), do: :error

  defp validate_request_opts!(opts) do
    where = "EMLXAxon.Scheduler.submit/3"
    opts = Options.validate!(opts, @submit_schema, where)

    native =
      opts
      |> Map.put(:profile_timing, false)
      |> Options.native()
      |> Map.drop([:profile_timing, :row_seeds])
      |> Map.put(:constraint, Options.constraint!(opts, where))

    {native, opts.timeout}
  end
end
