defmodule EMLXAxon.Hub.Cache do
  @moduledoc false
  # The download cache, laid out as huggingface_hub lays out its own:
  #
  #     <cache>/models--<org>--<name>/
  #       blobs/<etag>                 a file's bytes, named by its ETag
  #       blobs/<etag>.part            an unfinished download (resumed)
  #       refs/<revision>              the commit a branch or tag last named
  #       snapshots/<commit>/<file>    a link to the file's blob
  #
  # A blob only appears under its name once complete and checked (it is
  # renamed from its .part), and links and refs are replaced by rename, so
  # a reader never sees a half-written file.

  @doc false
  @spec default_dir() :: Path.t()
  def default_dir do
    cond do
      (dir = System.get_env("EMLX_AXON_CACHE_DIR")) not in [nil, ""] ->
        Path.expand(dir)

      (xdg = System.get_env("XDG_CACHE_HOME")) not in [nil, ""] ->
        Path.join(Path.expand(xdg), "emlx_axon")

      true ->
        Path.expand("~/.cache/emlx_axon")
    end
  end

  @doc false
  @spec repo_dir(Path.t(), String.t()) :: Path.t()
  def repo_dir(cache_dir, repo),
    do: Path.join(cache_dir, "models--" <> String.replace(repo, "/", "--"))

  @doc false
  # Blobs are named by ETag; an ETag that is not a plain token (it comes
  # from a server) is hashed so that it can never name a path.
  @spec blob_path(Path.t(), String.t()) :: Path.t()
  def blob_path(repo_dir, etag) do
    name =
      if etag =~ ~r/\A[A-Za-z0-9_-]{1,128}\z/,
        do: etag,
        else: :crypto.hash(:sha256, etag) |> Base.encode16(case: :lower)

    Path.join([repo_dir, "blobs", name])
  end

  @doc false
  @spec snapshot_dir(Path.t(), String.t()) :: Path.t()
  def snapshot_dir(repo_dir, commit), do: Path.join([repo_dir, "snapshots", commit])

  @doc false
  @spec read_ref(Path.t(), String.t()) :: {:ok, String.t()} | :error
  def read_ref(repo_dir, revision) do
    case File.read(Path.join([repo_dir, "refs", revision])) do
      {:ok, commit} ->
        commit = String.trim(commit)
        if commit =~ ~r/\A[0-9a-f]{40}\z/, do: {:ok, commit}, else: :error

      {:error, _} ->
        :error
    end
  end

  @doc false
  @spec write_ref(Path.t(), String.t(), String.t()) :: :ok | {:error, term()}
  def write_ref(repo_dir, revision, commit),
    do: write_atomic(Path.join([repo_dir, "refs", revision]), commit)

  @doc false
  # Writes `data` to a temporary file beside `path`, then renames it there.
  @spec write_atomic(Path.t(), iodata()) :: :ok | {:error, term()}
  def write_atomic(path, data) do
    tmp = tmp_name(path)

    with :ok <- File.mkdir_p(Path.dirname(path)) do
      replace(File.write(tmp, data), tmp, path)
    end
  end

  @doc false
  # Makes `link` (a file of a snapshot) point at `blob`: a relative
  # symbolic link, else a hard link, else a copy; replaced atomically.
  @spec link(Path.t(), Path.t()) :: :ok | {:error, term()}
  def link(blob, link) do
    tmp = tmp_name(link)

    with :ok <- File.mkdir_p(Path.dirname(link)) do
      result =
        with {:error, _} <- File.ln_s(relative(blob, Path.dirname(link)), tmp),
             {:error, _} <- File.ln(blob, tmp),
             {:ok, _} <- File.copy(blob, tmp) do
          :ok
        end

      replace(result, tmp, link)
    end
  end

  # Renames `tmp`, once `made` says it was written, over `path`; removes it
  # where that failed, so no half-written file stays.
  defp replace(made, tmp, path) do
    with :ok <- made, :ok <- File.rename(tmp, path) do
      :ok
    else
      error ->
        File.rm(tmp)
        error
    end
  end

  defp relative(target, from_dir) do
    target = Path.split(target)
    from = Path.split(from_dir)
    common = target |> Enum.zip(from) |> Enum.take_while(fn {a, b} -> a == b end) |> length()
    ups = List.duplicate("..", length(from) - common)
    Path.join(ups ++ Enum.drop(target, common))
  end

  @doc false
  @spec tmp_name(Path.t()) :: Path.t()
  def tmp_name(path), do: "#{path}.#{System.unique_integer([:positive])}.tmp"
end
