defmodule Mix.Tasks.EmlxAxon.Generate do
  @shortdoc "Generates text with a Qwen checkpoint"

  @options_doc """
    * `--model DIR` - the checkpoint directory (default: the small test
      checkpoint `.cache/fixtures/qwen3-4bit-g64` that `scripts/setup` builds),
      or `hf:ORG/NAME` (`hf:ORG/NAME@REVISION`) for a Hugging Face Hub
      repository, downloaded into the cache first (see `EMLXAxon.Hub`;
      `HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_OFFLINE` and `EMLX_AXON_CACHE_DIR`
      apply)
    * `--offline` - with `hf:`, use only the cache
    * `--prompt TEXT` - the prompt (default: `"The capital of France is"`)
    * `--prompt-ids 1,2,3` - a tokenized prompt, instead of `--prompt`
    * `--chat` - render the prompt with the chat template, as a user message
    * `--dtype float32|bfloat16|float16` - the compute dtype (default:
      float32 on the CPU, bfloat16 on a GPU)
    * `--max-new-tokens N` - default 32
    * `--max-len N` - the KV cache length per prompt, prompt included
      (default 2048)
    * `--kv-bits N` - keep the KV cache quantized to N bits (2-6 or 8) once it
      holds `--quantized-kv-start` positions (default 5000), in groups of
      `--kv-group-size` (32, 64 or 128; default 64), as mlx-lm's `--kv-bits`
    * `--max-kv-size N` - a rotating KV cache of at most N positions, as
      mlx-lm's `--max-kv-size`
    * `--kv-dtype float32|bfloat16|float16` - the KV cache's dtype (default:
      `float16` under the CPU's float32, which halves what a long context's
      steps read there; the compute dtype elsewhere)
    * `--sampler greedy|top_p_cpu|top_p_gpu` - default `greedy`
    * `--seed N`, `--temperature F`, `--top-p F`, `--top-k N`
    * `--json` - print exactly one JSON object instead, with the keys
      `prompt_ids`, `generated_ids`, `text`, `finish_reason`, `prefill_ms`,
      `decode_tokens_per_s` and `time_to_first_token_ms`
    * `--help` - print these options
  """

  @moduledoc """
  Generates text with a Qwen checkpoint, printing it as it is generated,
  then a timing line.

      mix emlx_axon.generate
      mix emlx_axon.generate --model ~/models/Qwen3-0.6B-MLX-4bit --chat --prompt "Name three rivers."
      mix emlx_axon.generate --model hf:mlx-community/Qwen3-0.6B-4bit --prompt "Hello"
      mix emlx_axon.generate --prompt-ids 785,6722,315,9625,374 --max-new-tokens 8 --json

  ## Options

  #{@options_doc}
  """

  use Mix.Task

  require Logger

  alias EMLXAxon.{Hub, JSON, TextGeneration, Tokenizer}
  alias EMLXAxon.Qwen3.Loader

  @default_model ".cache/fixtures/qwen3-4bit-g64"
  @default_prompt "The capital of France is"

  @switches [
    model: :string,
    prompt: :string,
    prompt_ids: :string,
    chat: :boolean,
    dtype: :string,
    max_new_tokens: :integer,
    max_len: :integer,
    kv_bits: :integer,
    kv_group_size: :integer,
    quantized_kv_start: :integer,
    max_kv_size: :integer,
    kv_dtype: :string,
    sampler: :string,
    seed: :integer,
    temperature: :float,
    top_p: :float,
    top_k: :integer,
    json: :boolean,
    offline: :boolean,
    help: :boolean
  ]

  # What each valued option takes, for the error naming a bad value.
  @expects %{
    string: "a value",
    integer: "an integer",
    float: "a number"
  }

  @impl Mix.Task
  def run(argv) do
    {opts, args, invalid} = OptionParser.parse(argv, strict: @switches, aliases: [h: :help])

    cond do
      opts[:help] ->
        Mix.shell().info(
          "Usage: mix emlx_axon.generate [options]\n\nOptions:\n\n" <> @options_doc
        )

      invalid != [] ->
        Mix.raise(Enum.map_join(invalid, "\n", &format_invalid/1))

      args != [] ->
        Mix.raise(
          "unexpected argument(s): #{Enum.join(args, " ")}; see `mix help emlx_axon.generate`"
        )

      true ->
        generate(opts)
    end
  end

  defp generate(opts) do
    json? = Keyword.get(opts, :json, false)
    start_app(json?)

    model = model_dir!(opts, json?)

    load_opts = if dtype = opts[:dtype], do: [dtype: parse_dtype!(dtype)], else: []
    tokenizer = ok!(Tokenizer.load(model), "loading the tokenizer from #{model}")
    state = ok!(Loader.load(model, load_opts), "loading the model from #{model}")

    input =
      case opts[:prompt_ids] do
        nil ->
          prompt = Keyword.get(opts, :prompt, @default_prompt)
          if opts[:chat], do: [%{role: "user", content: prompt}], else: prompt

        ids ->
          if opts[:prompt], do: Mix.raise("give either --prompt or --prompt-ids, not both")
          if opts[:chat], do: Mix.raise("--chat applies to --prompt, not --prompt-ids")
          %{input_ids: parse_ids!(ids)}
      end

    gen_opts =
      [
        max_new_tokens: Keyword.get(opts, :max_new_tokens, 32),
        max_len: Keyword.get(opts, :max_len, 2048),
        sampler: parse_sampler!(Keyword.get(opts, :sampler, "greedy")),
        profile_timing: true
      ] ++
        Keyword.take(opts, [
          :seed,
          :temperature,
          :top_p,
          :top_k,
          :kv_bits,
          :kv_group_size,
          :quantized_kv_start,
          :max_kv_size
        ]) ++ kv_dtype(opts)

    {:ok, prompt_ids} = prompt_ids(tokenizer, state, input)

    output =
      try do
        if json? do
          TextGeneration.run(tokenizer, state, input, gen_opts)
        else
          result = TextGeneration.stream(tokenizer, state, input, &IO.write/1, gen_opts)
          IO.write("\n")
          result
        end
      rescue
        e in [ArgumentError, EMLXAxon.Error] -> Mix.raise(Exception.message(e))
      end

    %{results: [%{token_ids: ids, generated_text: text, finish_reason: reason}], metadata: meta} =
      output

    if json? do
      IO.puts(
        JSON.encode!(%{
          prompt_ids: prompt_ids,
          generated_ids: ids,
          text: text,
          finish_reason: reason,
          prefill_ms: meta.prefill_ms,
          decode_tokens_per_s: meta.decode_tokens_per_s,
          time_to_first_token_ms: meta.time_to_first_token_ms
        })
      )
    else
      Mix.shell().info(
        "-- #{length(ids)} tokens (#{reason}); prompt #{length(prompt_ids)} tokens, " <>
          "prefill #{fmt(meta.prefill_ms)} ms, first token #{fmt(meta.time_to_first_token_ms)} ms, " <>
          "decode #{fmt(meta.decode_tokens_per_s)} tokens/s"
      )
    end

    :ok
  end

  defp start_app(json?) do
    # With --json, stdout must hold only the JSON object.
    if json? do
      shell = Mix.shell()
      Mix.shell(Mix.Shell.Quiet)

      try do
        Mix.Task.run("app.start")
      after
        Mix.shell(shell)
      end
    else
      Mix.Task.run("app.start")
    end
  end

  defp model_dir!(opts, json?) do
    case Keyword.get_lazy(opts, :model, &default_model/0) do
      "hf:" <> name ->
        {repo, revision} =
          case String.split(name, "@", parts: 2) do
            [repo, revision] when revision != "" -> {repo, revision}
            [repo | _] -> {repo, "main"}
          end

        hub_opts = [revision: revision, progress: &progress/1]
        hub_opts = if opts[:offline], do: [offline: true] ++ hub_opts, else: hub_opts

        fetch = fn ->
          try do
            Hub.fetch({:hf, repo, hub_opts})
          rescue
            e in ArgumentError -> Mix.raise("--model #{name}: #{Exception.message(e)}")
          end
        end

        # With --json, stdout holds only the JSON object: no log lines.
        case quiet_logger(json?, fetch) do
          {:ok, dir} -> dir
          {:error, error} -> Mix.raise("fetching #{repo}: #{Exception.message(error)}")
        end

      dir ->
        if opts[:offline], do: Mix.raise("--offline applies to --model hf:REPO")
        model = Path.expand(dir)

        unless File.dir?(model) do
          Mix.raise(
            "model directory #{model} does not exist. " <>
              if(opts[:model],
                do: "Pass --model with a checkpoint directory (or hf:ORG/NAME).",
                else: "Run scripts/setup to build the test checkpoints, or pass --model DIR."
              )
          )
        end

        model
    end
  end

  defp quiet_logger(false, fun), do: fun.()

  defp quiet_logger(true, fun) do
    level = Logger.level()
    Logger.configure(level: :warning)

    try do
      fun.()
    after
      Logger.configure(level: level)
    end
  end

  # One line per file on stderr, rewritten as the file downloads.
  defp progress(%{file: file, bytes: bytes, total: total}) do
    done = if total, do: "#{mib(bytes)}/#{mib(total)} MiB", else: "#{mib(bytes)} MiB"
    ending = if total != nil and bytes >= total, do: "\n", else: ""
    IO.write(:stderr, "\rDownloading #{file}: #{done}#{ending}")
  end

  defp mib(bytes), do: :erlang.float_to_binary(bytes / 1_048_576, decimals: 1)

  defp prompt_ids(tokenizer, state, input) do
    opts = %{chat: false, enable_thinking: nil}
    {[%{ids: ids}], false} = TextGeneration.Input.requests!(tokenizer, state, input, opts)
    {:ok, ids}
  rescue
    e in [ArgumentError, EMLXAxon.Error] -> Mix.raise(Exception.message(e))
  end

  defp default_model do
    root =
      case Mix.Project.deps_paths()[:emlx_axon] do
        nil -> Path.dirname(Mix.Project.project_file() || Path.join(File.cwd!(), "mix.exs"))
        dep_path -> dep_path
      end

    Path.join(root, @default_model)
  end

  defp parse_ids!(ids) do
    ids
    |> String.split(",", trim: true)
    |> Enum.map(fn id ->
      case Integer.parse(String.trim(id)) do
        {int, ""} when int >= 0 -> int
        _ -> Mix.raise("--prompt-ids must be comma-separated token ids, got: #{inspect(ids)}")
      end
    end)
    |> case do
      [] -> Mix.raise("--prompt-ids must not be empty")
      list -> list
    end
  end

  # Atoms written out here: in a fresh VM the modules naming them may not
  # be loaded yet, so String.to_existing_atom/1 could fail.
  @dtypes [:float32, :bfloat16, :float16]

  defp parse_dtype!(name), do: choice!("--dtype", name, @dtypes)

  defp kv_dtype(opts) do
    case Keyword.fetch(opts, :kv_dtype) do
      :error -> []
      {:ok, name} -> [kv_dtype: choice!("--kv-dtype", name, EMLXAxon.Options.kv_dtypes())]
    end
  end

  defp parse_sampler!(name), do: choice!("--sampler", name, EMLXAxon.Options.samplers())

  # The atom of `choices` named `name`, or a Mix error naming the flag.
  defp choice!(flag, name, choices) do
    case Enum.find(choices, &(Atom.to_string(&1) == name)) do
      nil ->
        Mix.raise(
          "#{flag} must be one of #{Enum.map_join(choices, ", ", &Atom.to_string/1)}, got: #{name}"
        )

      choice ->
        choice
    end
  end

  defp ok!({:ok, value}, _what), do: value
  defp ok!({:error, error}, what), do: Mix.raise("#{what} failed: #{Exception.message(error)}")

  defp fmt(number) when is_float(number), do: :erlang.float_to_binary(number, decimals: 1)
  defp fmt(number), do: to_string(number)

  defp format_invalid({name, value}) do
    switch = name |> String.trim_leading("-") |> String.replace("-", "_")
    type = Enum.find_value(@switches, fn {key, type} -> Atom.to_string(key) == switch && type end)

    cond do
      type != nil and value != nil ->
        "invalid option #{name} #{value}: #{name} takes #{@expects[type]}"

      type != nil ->
        "invalid option #{name}: #{name} takes #{@expects[type]}"

      true ->
        accepted = Enum.map_join(@switches, ", ", fn {key, _} -> "--#{dashed(key)}" end)

        "invalid option #{name}: unknown option; the options are #{accepted} " <>
          "(see mix emlx_axon.generate --help)"
    end
  end

  defp dashed(key), do: key |> Atom.to_string() |> String.replace("_", "-")
end
